"""The TTT step loss's share of a training micro-batch, per loss and draft vocabulary (CPU).

    .venv/bin/python bench/bench_loss.py [--tokens 2048] [--ttt 3] [--autocast bf16]
        [--draft-vocab 4096 49152] [--loss kl lk_alpha lk_lambda]

bench/bench_train.py's SmolLM2-135M-sized drafter and packed batch; per (draft vocabulary,
loss): one forward + backward of the whole TTT unroll (`ttt_forward`, as stage 04 runs it, under
bf16 autocast by default as configs/smollm2-135m-quality.yaml trains) and, apart, the step
losses alone (`step_loss` forward + backward on the unroll's logits and teacher rows). The
teacher is built once, outside the timing. Best of `--iters` after `--warmup`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_teacher_kimi import best_of  # noqa: E402
from bench_train import setup  # noqa: E402

from eagle3.model import causal_doc_mask  # noqa: E402
from eagle3.shards import collate  # noqa: E402
from eagle3.teacher import VerifierHead, make_teacher  # noqa: E402
from eagle3.ttt import TTTSpec, p_tilde_normalizer, step_loss, ttt_forward  # noqa: E402


def measure(args: argparse.Namespace, draft_vocab: int, loss: str) -> dict:
    args.draft_vocab = draft_vocab
    model, verifier_head, _, _, docs = setup(args)
    batch = collate([{k: v for k, v in d.items() if k != "y"} for d in docs], 1 << 30)
    teacher = make_teacher(batch.final, VerifierHead.of(verifier_head,
                                                        torch.arange(draft_vocab) + model.d2t))
    spec = TTTSpec(args.ttt, 0.8, loss)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast == "bf16"
                else contextlib.nullcontext())

    def unroll() -> None:
        with autocast:
            total, _ = ttt_forward(model, batch, teacher, spec)
        total.backward()
        model.zero_grad(set_to_none=True)

    # the step losses alone: the logits of one unroll's last step stand for every step's
    with torch.no_grad(), autocast:
        h = model.project(batch.aux)
        _, logits = model.step(h, batch.input_ids, batch.positions,
                               causal_doc_mask(batch.doc_ids), model.new_cache())
    t_lse = p_tilde_normalizer(teacher, spec)
    weight = batch.loss_mask.float()
    n = batch.loss_mask.sum()

    def losses() -> None:
        for k in range(args.ttt):
            z = logits.detach().requires_grad_()
            rows = slice(1 + k, None)
            value, _ = step_loss(spec, z, teacher.draft_logits[:, rows], t_lse[:, rows],
                                 teacher.lse[:, rows], weight, n)
            value.backward()

    return {"draft_vocab": draft_vocab, "loss": loss, "autocast": args.autocast,
            "tokens": args.tokens, "ttt": args.ttt,
            "unroll_s": round(timed(unroll, args), 3),
            "step_losses_s": round(timed(losses, args), 3)}


def timed(fn, args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        fn()
    return best_of(args.iters, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens per micro-batch")
    ap.add_argument("--docs", type=int, default=5, help="documents in the packed batch")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--autocast", choices=["bf16", "off"], default="bf16")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[4096, 49152])
    ap.add_argument("--loss", nargs="+", default=["kl", "lk_alpha", "lk_lambda"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    for vocab in args.draft_vocab:
        for loss in args.loss:
            print(json.dumps(measure(args, vocab, loss)), flush=True)


if __name__ == "__main__":
    main()
