"""TTT attention alone, forward + backward: the fused flash-attention kernel merged with the
diagonal keys against the plain blocked recurrence (`eagle3/model.py` `TTTAttention`).

    .venv/bin/python bench/bench_attention.py [--lengths 1024,4096] [--heads 8] [--head-dim 64]

One document of L tokens, `--later` diagonal keys per query (the later TTT steps), float32 and
bfloat16; best of `--iters` after one warm-up, and each path's largest error against a float32
run of the recurrence (relative to the largest reference value, output and every gradient).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.model import TTTAttention, fused_kernel  # noqa: E402


def run(inputs: list[torch.Tensor], dtype: torch.dtype, fused: bool, chunk: int
        ) -> list[torch.Tensor]:
    xs = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
    q = xs[0]
    out = TTTAttention.apply(*xs, q.shape[-1] ** -0.5, chunk,
                             fused_kernel(q) if fused else None)
    out.float().square().sum().backward()
    return [out.detach()] + [x.grad for x in xs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--later", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads} x "
          f"{args.head_dim}, {args.later} diagonal keys")
    for L in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(0)
        h, d, n = args.heads, args.head_dim, args.later
        inputs = [torch.randn(1, h, L, d) for _ in range(3)] + [
            torch.randn(1, h, L, n, d) for _ in range(2)]
        chunk = max(16, (1 << 26) // (h * L))
        truth = run(inputs, torch.float32, False, chunk)
        for dtype in (torch.float32, torch.bfloat16):
            row = []
            for fused in (False, True):
                run(inputs, dtype, fused, chunk)  # warm-up (and the kernel's first-use check)
                times = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    got = run(inputs, dtype, fused, chunk)
                    times.append(time.perf_counter() - t)
                err = max(((a.float() - b).abs().max() / b.abs().max()).item()
                          for a, b in zip(got, truth))
                row.append(f"{'fused' if fused else 'recurrence'} {min(times):.3f} s "
                           f"(max rel. error {err:.2%})")
            print(f"L {L:>6} {str(dtype).removeprefix('torch.'):>8}: " + ", ".join(row))


if __name__ == "__main__":
    main()
