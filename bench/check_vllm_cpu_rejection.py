"""Does vLLM-CPU's rejection sampler accept a greedy draft with the verifier's probability?

    .venv/bin/python bench/check_vllm_cpu_rejection.py

Calls the compiled CPU kernel vLLM 0.32 registers for sampled (T > 0) requests,
`torch.ops._C.rejection_random_sample_kernel_impl`, through vLLM's own wrapper, on random
target distributions with no draft probabilities (vLLM's EAGLE path: the draft is the
drafter's argmax, taken as probability 1). Speculative sampling must then accept the first
draft with probability p(draft); the script prints the kernel's acceptance rate beside the mean
p and the rate its own uniform draws imply. Part of the T = 0.6 investigation in
bench/RESULTS.md ("LK losses vs KL").
"""

import torch
import vllm._C  # noqa: F401  (registers the CPU kernels)
from vllm.utils import cpu_triton_utils

RECOVERED, BONUS = 10_001, 10_002


def main(requests: int = 4000, k: int = 3, vocab: int = 16) -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(requests * k, vocab), -1).contiguous()
    draft = torch.randint(0, vocab, (requests * k,), dtype=torch.int64)
    out = torch.full((requests, k + 1), -1, dtype=torch.int64)
    uniform = torch.rand(requests * k, dtype=torch.float64)
    cpu_triton_utils._rejection_random_sample_kernel_impl(
        out, torch.arange(1, requests + 1, dtype=torch.int64) * k, draft, None, p,
        torch.full((requests,), BONUS, dtype=torch.int64),
        torch.full((requests * k,), RECOVERED, dtype=torch.int64), uniform,
        torch.zeros(requests, dtype=torch.bool), k, vocab, None, True, False)
    p_draft = p.gather(1, draft[:, None]).view(requests, k)[:, 0]
    accepted = (out[:, 0] == draft.view(requests, k)[:, 0]).float().mean()
    implied = (uniform.view(requests, k)[:, 0] <= p_draft.double()).float().mean()
    print(f"first-position acceptance {accepted:.4f}; mean p(draft) {p_draft.mean():.4f}; "
          f"implied by the kernel's uniform draws {implied:.4f}")


if __name__ == "__main__":
    main()
