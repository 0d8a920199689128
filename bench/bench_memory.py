"""Peak memory of one training micro-batch (teacher + TTT forward + backward): against the
length L of its one document, and against the drafter's widths. The fits are what
`python -m eagle3.plan` uses to predict stage 04's per-GPU peak.

    .venv/bin/python bench/bench_memory.py fit      # widths + long lengths, checkpointing off
                                                    # and on: eagle3/memory_fit.json (~20 min)
    .venv/bin/python bench/bench_memory.py refit    # the fit again from the rows in that file
    .venv/bin/python bench/bench_memory.py lengths [--lengths 1024,2048,4096,8192,16384]
    .venv/bin/python bench/bench_memory.py widths  [--length 4096]
    .venv/bin/python bench/bench_memory.py mla     [--length 4096]  # MLA vs MHA vs the plan
    options: --ttt 3  --autocast bf16|off  --checkpointing  --repo PATH (another checkout)

`lengths` fits peak = a + b*L + c*(heads*steps*L^2) at a reduced width that fits a 24 GB
machine at 16k tokens: hidden 512 (also the verifier's), 4 heads x 128, MLP 1024, verifier
vocabulary 16384, draft vocabulary 1024. `widths` holds L and varies the draft vocabulary, the
hidden size, the MLP size and the heads one at a time; `fit` adds longer documents and fits a
constant transient plus bytes per token and TTT step (`fit_widths`).

Each point runs in its own subprocess under bf16 autocast with float32 master weights (what
stage 04 runs on a GPU), after one small warm-up step (the code pages and thread pools a first
step loads are not activations); gradients exist before the step, so the peak is the rise of
`ru_maxrss` over the resident size right before it: activations, the teacher and transients.
A CPU allocator is not CUDA's: the fit is checked on a GPU where one is lent (bench/RESULTS.md).
To compare with older code: `git worktree add /tmp/before REV`, then `--repo /tmp/before`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
from typing import Any
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIT_FILE = REPO / "eagle3" / "memory_fit.json"
VERIFIER_VOCAB = 16384
BASE = {"hidden": 512, "intermediate": 1024, "draft_vocab": 1024, "heads": 4}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# An MLA layer at BASE's width, with Kimi's proportions where they fit (DeepSeek-V2 widths over
# 4 heads of 128: q/k of nope 96 + rope 32, v 128, latents 256 and 128).
MLA = {"q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 96, "qk_rope_head_dim": 32,
       "v_head_dim": 128}


def draft_shape(config_class: type, hidden: int, intermediate: int, draft_vocab: int,
                heads: int, attention: str = "mha") -> Any:
    """The measured drafter's config (`config_class`: DraftModelConfig of the code measured)."""
    return config_class(hidden_size=hidden, target_hidden_size=hidden, num_aux=3,
                        intermediate_size=intermediate, num_attention_heads=heads,
                        num_key_value_heads=heads, head_dim=128, num_layers=1,
                        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=1 << 20,
                        vocab_size=VERIFIER_VOCAB, draft_vocab_size=draft_vocab,
                        **({"attention": "mla", **MLA} if attention == "mla" else {}))


def worker(repo: str, L: int, hidden: int, intermediate: int, draft_vocab: int, heads: int,
           ttt: int, autocast: str, checkpointing: bool, attention: str = "mha") -> dict:
    sys.path.insert(0, repo)
    from eagle3.model import DraftModelConfig, Eagle3DraftModel
    from eagle3.shards import collate
    from eagle3.teacher import VerifierHead, make_teacher
    from eagle3.ttt import TTTSpec, ttt_forward

    torch.manual_seed(0)
    H, V, VD = hidden, VERIFIER_VOCAB, draft_vocab
    model = Eagle3DraftModel(draft_shape(DraftModelConfig, H, intermediate, VD, heads, attention))
    with torch.no_grad():
        model.t2d[:VD] = True
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    head = VerifierHead.of(torch.randn(V, H) * 0.02, torch.arange(VD))
    spec = TTTSpec(ttt_steps=ttt, step_decay=0.8,
                   **({"checkpoint_steps": True} if checkpointing else {}))  # older code: no field

    def step(n: int) -> None:
        doc = {"input_ids": torch.randint(0, V, (n,)),
               "loss_mask": torch.ones(n, dtype=torch.long),
               "aux": torch.randn(n, 3 * H), "final": torch.randn(n, H)}
        batch = collate([doc], 1 << 30)
        teacher = make_teacher(batch.final, head, None, None, None)
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast == "bf16"
               else contextlib.nullcontext())
        nonlocal before, base
        before = rss_bytes()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with ctx:  # as stage 04's train_step: teacher outside, forward and backward inside
            loss, _ = ttt_forward(model, batch, teacher, spec)
            loss.backward()

    before = base = 0
    step(64)  # code pages and thread pools the first step loads are not activations
    step(L)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"L": L, "hidden": H, "intermediate": intermediate, "draft_vocab": VD,
            "heads": heads, "ttt": ttt, "checkpointing": checkpointing, "attention": attention,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "peak_rise_bytes": max(peak - max(before, base), 0)}


def measure(args: argparse.Namespace, **point: int) -> dict:
    spec = {**BASE, **point}
    cmd = [sys.executable, __file__, "worker", "--repo", args.repo, "--ttt", str(args.ttt),
           "--autocast", args.autocast, "--point", json.dumps(spec)]
    if args.checkpointing:
        cmd.append("--checkpointing")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{spec}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{spec}: peak rise {row['peak_rise_bytes'] / 2**20:.0f} MiB", flush=True)
    return row


def lstsq(X: list[list[float]], y: list[float]) -> list[float]:
    A = torch.tensor(X, dtype=torch.float64)
    return torch.linalg.lstsq(A, torch.tensor(y, dtype=torch.float64)[:, None]
                              ).solution[:, 0].tolist()


def fit_lengths(rows: list[dict]) -> dict:
    """peak = a + b*L + c*(heads*steps*L^2)."""
    coef = lstsq([[1.0, r["L"], r["heads"] * r["ttt"] * r["L"] ** 2] for r in rows],
                 [float(r["peak_rise_bytes"]) for r in rows])
    return {"const_bytes": round(coef[0]), "bytes_per_token": round(coef[1], 1),
            "bytes_per_head_L2_step": round(coef[2], 4)}


def fit_widths(rows: list[dict]) -> dict:
    """peak - weight casts = transient + L*steps*(b0 + bV*draft_vocab + bH*hidden
    + bI*intermediate + bA*heads*head_dim), over points whose attention blocks are full (the
    transient, a few float32 blocks of `ATTENTION_BLOCK_ELEMENTS` scores, is then one constant
    whatever L and the heads). Not measured here, and added by `eagle3.plan` itself: the batch
    and the teacher (built before the step) and autocast's bf16 copy of the trainable weights
    (2 bytes per parameter, subtracted here)."""
    X = [[1.0] + [r["L"] * r["ttt"] * w for w in
                  (1.0, r["draft_vocab"], r["hidden"], r["intermediate"], r["heads"] * 128)]
         for r in rows]
    y = [r["peak_rise_bytes"] - 2 * r["trainable"] for r in rows]
    coef = lstsq(X, y)
    fit = {"transient_bytes": round(coef[0]), "per_token_step": {k: round(c, 3) for k, c in zip(
        ("const", "draft_vocab", "hidden", "intermediate", "attention"), coef[1:])}}
    predicted = [sum(a * b for a, b in zip(x, coef)) for x in X]
    fit["max_relative_residual"] = round(max(abs(p - v) / v for p, v in zip(predicted, y)), 4)
    return fit


WIDTHS = [{}, {"draft_vocab": 4096}, {"draft_vocab": 8192}, {"hidden": 1024}, {"hidden": 2048},
          {"intermediate": 4096}, {"intermediate": 8192}, {"heads": 8}, {"heads": 16}]
FIT_LENGTHS = (8192, 16384)
"""Lengths added to the width points (at --length 4096) in `fit`: at 4 heads and 4096 tokens
and beyond, the attention's blocks are full."""


def fit_file(args: argparse.Namespace) -> dict:
    """The fit with activation checkpointing off and on: what `eagle3.plan` reads."""
    import datetime
    import platform
    out = {"measured": f"{datetime.date.today()} by bench/bench_memory.py fit on "
                       f"{platform.machine()}, torch {torch.__version__}, "
                       f"autocast {args.autocast}, TTT {args.ttt}"}
    for mode in ("plain", "checkpointed"):
        args.checkpointing = mode == "checkpointed"
        rows = [measure(args, L=args.length, **p) for p in WIDTHS]
        rows += [measure(args, L=L) for L in FIT_LENGTHS]
        out[mode] = {**fit_widths(rows), "rows": rows}
        print(json.dumps({mode: {k: v for k, v in out[mode].items() if k != "rows"}}),
              flush=True)
    return out


def mla_against_plan(args: argparse.Namespace) -> list[dict]:
    """The plan predicts an MLA layer's activations with the MHA fit (eagle3.plan
    `activation_bytes`: its head_dim is nope + rope): measure both layers at one length,
    checkpointing off and on, beside that prediction (what the fit covers: the rise less
    autocast's bf16 weight copies)."""
    sys.path.insert(0, str(REPO))
    from eagle3.model import DraftModelConfig
    from eagle3.plan import activation_bytes

    fits = json.loads(FIT_FILE.read_text())
    out = []
    for checkpointing in (False, True):
        args.checkpointing = checkpointing
        fit = fits["checkpointed" if checkpointing else "plain"]
        for attention in ("mha", "mla"):
            row = measure(args, L=args.length, attention=attention)
            shape = draft_shape(DraftModelConfig, BASE["hidden"], BASE["intermediate"],
                                BASE["draft_vocab"], BASE["heads"], attention)
            per_token = 4 * shape.draft_vocab_size + 4 * (shape.num_aux + 1) * shape.hidden_size
            predicted = activation_bytes(fit, shape, args.ttt, args.length) \
                - args.length * per_token  # the batch and teacher: built before the step
            measured = row["peak_rise_bytes"] - 2 * row["trainable"]
            out.append({"attention": attention, "checkpointing": checkpointing,
                        "L": args.length, "trainable": row["trainable"],
                        "measured_MiB": round(measured / 2**20, 1),
                        "plan_MiB": round(predicted / 2**20, 1),
                        "plan_error": round((predicted - measured) / measured, 3)})
            print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["fit", "refit", "lengths", "widths", "mla", "worker"])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--autocast", choices=["bf16", "off"], default="bf16")
    parser.add_argument("--checkpointing", action="store_true",
                        help="train.activation_checkpointing on")
    parser.add_argument("--repo", default=str(REPO))
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        p = json.loads(args.point)
        print(json.dumps(worker(args.repo, p["L"], p["hidden"], p["intermediate"],
                                p["draft_vocab"], p["heads"], args.ttt, args.autocast,
                                args.checkpointing, p.get("attention", "mha"))))
        return
    if args.mode == "mla":
        print(json.dumps(mla_against_plan(args), indent=1))
        return
    if args.mode == "lengths":
        rows = []
        for L in (int(x) for x in args.lengths.split(",")):
            try:
                rows.append(measure(args, L=L))
            except RuntimeError as e:
                print(f"L={L} failed: {e}", flush=True)
                break
        print(json.dumps({"rows": rows, "fit": fit_lengths(rows) if len(rows) >= 3 else None}))
        return
    if args.mode == "fit":
        FIT_FILE.write_text(json.dumps(fit_file(args), indent=1) + "\n")
        print(f"wrote {FIT_FILE}")
        return
    if args.mode == "refit":  # the fit again from the rows the file holds
        saved = json.loads(FIT_FILE.read_text())
        for mode in ("plain", "checkpointed"):
            saved[mode] = {**fit_widths(saved[mode]["rows"]), "rows": saved[mode]["rows"]}
        FIT_FILE.write_text(json.dumps(saved, indent=1) + "\n")
        print(json.dumps({m: {k: v for k, v in saved[m].items() if k != "rows"}
                          for m in ("plain", "checkpointed")}, indent=1))
        return
    rows = [measure(args, L=args.length, **p) for p in WIDTHS]
    print(json.dumps({"rows": rows, "fit": fit_widths(rows)}))


if __name__ == "__main__":
    main()
