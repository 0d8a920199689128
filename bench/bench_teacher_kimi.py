"""The teacher's share of a training step at Kimi-K2.5's shape (issue 15: 55% of a step at a
262k vocabulary with a tiny hidden size; what is it for the drafter users actually train?).

    .venv/bin/python bench/bench_teacher_kimi.py [--tokens 128] [--ttt 7] [--repeats 2]

Synthetic: verifier hidden 7168, vocabulary 163,840, draft vocabulary 32,000, the published
Kimi drafter's layer (64 heads of 128, MLP 18432) in bf16 (fp32 would need ~20 GB here), the
verifier's head in fp32 as the trainer holds it, `--tokens` supervised tokens in one packed
micro-batch. Times `make_teacher` (the full-vocabulary product, argmax, draft-vocabulary logits
and log-normalizer, as training builds it) against one TTT micro-batch forward + backward
(`ttt_forward`, `--ttt` steps, KL), each the best of `--repeats`; and, for scale, the product
over the draft vocabulary's rows alone (what would remain per epoch if the full argmax and
log-normalizer were computed once and cached).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.model import DraftModelConfig, Eagle3DraftModel  # noqa: E402
from eagle3.shards import collate  # noqa: E402
from eagle3.ttt import make_teacher, ttt_forward  # noqa: E402

H, VOCAB, DRAFT_VOCAB = 7168, 163840, 32000


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    cfg = DraftModelConfig(hidden_size=H, target_hidden_size=H, num_aux=3,
                           intermediate_size=18432, num_attention_heads=64,
                           num_key_value_heads=64, head_dim=128, num_layers=1,
                           rms_norm_eps=1e-5, rope_theta=50000.0,
                           max_position_embeddings=4096, vocab_size=VOCAB,
                           draft_vocab_size=DRAFT_VOCAB)
    with torch.device("meta"):
        model = Eagle3DraftModel(cfg)
    model = model.to_empty(device="cpu").to(dt)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        chosen = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
        model.d2t.copy_(chosen - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[chosen] = True
    model.embed_tokens.weight.requires_grad_(False)
    head = torch.randn(VOCAB, H) * 0.02  # fp32, as train.py holds the verifier's head
    T = args.tokens
    sample = {"input_ids": torch.randint(0, VOCAB, (T,)),
              "loss_mask": torch.ones(T, dtype=torch.long),
              "aux": torch.randn(T, 3 * H, dtype=dt), "final": torch.randn(T, H, dtype=dt)}
    batch = collate([sample], T)
    draft_ids = torch.arange(DRAFT_VOCAB) + model.d2t

    teacher_s = best_of(args.repeats, lambda: make_teacher(batch.final, head, draft_ids))
    teacher = make_teacher(batch.final, head, draft_ids)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss, _ = ttt_forward(model, batch, teacher, args.ttt, 0.8)
        loss.backward()

    step_s = best_of(args.repeats, step)
    draft_head = head[draft_ids].contiguous()
    cols_s = best_of(args.repeats, lambda: batch.final.reshape(-1, H).float() @ draft_head.T)
    share = teacher_s / (teacher_s + step_s)
    print(f"| {T} | {args.ttt} | {teacher_s:.2f} | {step_s:.2f} | {share:.1%} | {cols_s:.2f} |")


if __name__ == "__main__":
    main()
