"""The teacher's share of a training step at Kimi-K2.5's shape (issue 15: 55% of a step at a
262k vocabulary with a tiny hidden size; what is it for the drafter users actually train?).

    .venv/bin/python bench/bench_teacher_kimi.py [--tokens 128] [--ttt 7] [--repeats 2]

Synthetic: verifier hidden 7168, vocabulary 163,840, draft vocabulary 32,000, the published
Kimi drafter's layer (64 heads of 128, MLP 18432) in bf16 (fp32 would need ~20 GB here), the
verifier's head in fp32 as the trainer holds it, `--tokens` supervised tokens in one packed
micro-batch. Times `make_teacher` (the full-vocabulary product, argmax, draft-vocabulary logits
and log-normalizer, as training builds it) against one TTT micro-batch forward + backward
(`ttt_forward`, `--ttt` steps, KL), each the best of `--repeats`; and the teacher as every
epoch after a sample's first builds it, its full-vocabulary argmax and log-normalizer read from
`TeacherCache` (the draft-vocabulary product remains).
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
from eagle3.teacher import TeacherCache, VerifierHead, document_stats, make_teacher  # noqa: E402
from eagle3.ttt import TTTSpec, teacher_rows, ttt_forward  # noqa: E402

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
    # fp32, as train.py holds the verifier's head
    head = VerifierHead.of(torch.randn(VOCAB, H) * 0.02,
                           torch.arange(DRAFT_VOCAB) + model.d2t)
    T = args.tokens
    sample = {"input_ids": torch.randint(0, VOCAB, (T,)),
              "loss_mask": torch.ones(T, dtype=torch.long),
              "aux": torch.randn(T, 3 * H, dtype=dt), "final": torch.randn(T, H, dtype=dt)}
    batch = collate([sample], T)
    needed, cache = teacher_rows(batch), TeacherCache()

    def build_teacher():
        stats = document_stats(batch.final, batch.doc_end, needed, head, keys=[0], cache=cache)
        return make_teacher(batch.final, head, needed, stats=stats)

    cache.entries.clear()
    teacher_s = best_of(args.repeats, lambda: (cache.entries.clear(), build_teacher()))
    teacher = build_teacher()  # fills the cache
    cached_s = best_of(args.repeats, build_teacher)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss, _ = ttt_forward(model, batch, teacher, TTTSpec(args.ttt, 0.8))
        loss.backward()

    step_s = best_of(args.repeats, step)
    share = teacher_s / (teacher_s + step_s)
    cached_share = cached_s / (cached_s + step_s)
    print(f"| {T} | {args.ttt} | {teacher_s:.2f} | {step_s:.2f} | {share:.1%} | {cached_s:.2f} "
          f"| {cached_share:.1%} | {(teacher_s + step_s) / (cached_s + step_s):.3f}x |")


if __name__ == "__main__":
    main()
