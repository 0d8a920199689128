"""Peak memory of one training micro-batch (teacher + TTT forward + backward) against the
length L of its one document, and a least-squares fit peak = a + b*L + c*L^2*heads*steps.

    .venv/bin/python bench/bench_memory.py [--lengths 1024,2048,4096,8192,16384]
                                           [--hidden 512] [--heads 4] [--ttt 3]

A reduced width that fits a 24 GB machine at 16k tokens: hidden 512 (also the verifier's),
heads x 128, MLP 2 x hidden, verifier vocabulary 4096, draft vocabulary 1024, fp32, one layer.
Each length runs in its own subprocess; its peak is the rise of `ru_maxrss` over the resident
size right before the step (model and batch built). Run it on the code before and after a
change (e.g. `git worktree add /tmp/before REV` and run that copy) to compare fits.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(args: argparse.Namespace, L: int) -> dict:
    sys.path.insert(0, str(REPO))
    from eagle3.model import DraftModelConfig, Eagle3DraftModel
    from eagle3.shards import collate
    from eagle3.teacher import VerifierHead, make_teacher
    from eagle3.ttt import TTTSpec, ttt_forward

    torch.manual_seed(0)
    H, V, VD = args.hidden, 4096, 1024
    cfg = DraftModelConfig(hidden_size=H, target_hidden_size=H, num_aux=3,
                           intermediate_size=2 * H, num_attention_heads=args.heads,
                           num_key_value_heads=args.heads, head_dim=128, num_layers=1,
                           rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=1 << 20,
                           vocab_size=V, draft_vocab_size=VD)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        model.t2d[:VD] = True
    head = VerifierHead.of(torch.randn(V, H) * 0.02, torch.arange(VD))
    doc = {"input_ids": torch.randint(0, V, (L,)), "loss_mask": torch.ones(L, dtype=torch.long),
           "aux": torch.randn(L, 3 * H), "final": torch.randn(L, H)}
    batch = collate([doc], 1 << 30)
    before = rss_bytes()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    teacher = make_teacher(batch.final, head, None, None, None)
    loss, _ = ttt_forward(model, batch, teacher, TTTSpec(ttt_steps=args.ttt, step_decay=0.8))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"L": L, "peak_rise_bytes": peak - max(before, base) if peak > base else 0}


def fit(rows: list[dict], heads: int, steps: int) -> dict:
    """Least squares of peak = a + b*L + c*(heads*steps*L^2)."""
    X = torch.tensor([[1.0, r["L"], heads * steps * r["L"] ** 2] for r in rows],
                     dtype=torch.float64)
    y = torch.tensor([float(r["peak_rise_bytes"]) for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(X, y[:, None]).solution[:, 0].tolist()
    return {"const_bytes": coef[0], "bytes_per_token": coef[1],
            "bytes_per_head_L2_step": coef[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--worker", type=int, default=None)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args, args.worker)))
        return
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        out = subprocess.run([sys.executable, __file__, "--worker", str(L), "--hidden",
                              str(args.hidden), "--heads", str(args.heads), "--ttt",
                              str(args.ttt)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"L={L}: failed ({out.stderr.strip().splitlines()[-1:]})", flush=True)
            break
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"L={L}: peak rise {row['peak_rise_bytes'] / 2**20:.0f} MiB", flush=True)
    if len(rows) >= 3:
        print(json.dumps(fit(rows, args.heads, args.ttt), indent=1))


if __name__ == "__main__":
    main()
