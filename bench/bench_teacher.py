"""Training micro-batch cost on CPU: the teacher on every row vs only the rows a TTT step
reads, and fp32 vs bf16 autocast (`train.autocast`).

    .venv/bin/python bench/bench_teacher.py configs/smollm2-135m-quality.yaml [--batches 20]

The teacher is the verifier's full-vocabulary product (hidden x vocab per token, 576 x 49152
for SmolLM2), used for the draft-vocabulary soft target and the in-vocabulary argmax. Prompt
positions carry no loss under the default `train.loss_on: assistant`, so `teacher_rows`
skips them. After a sample's first epoch the trainer reads its full-vocabulary argmax and
log-normalizer from `TeacherCache`, leaving the draft-vocabulary product. This times
`make_teacher` these three ways and one whole training micro-batch (teacher + TTT forward +
backward, the trainer's path), in fp32 and under bf16 autocast, on the first packed batches of
a finished stage 02, as the trainer builds them.

With a full-vocabulary stage 03 (`vocab.draft_vocab_size=full`) it times instead the first
epoch's teacher two ways: the statistics from a second full product (`document_stats`, before)
and read off the draft product, which is the full one (`make_teacher` alone, now), and a bf16
training micro-batch (the config's loss) with each:

    .venv/bin/python bench/bench_teacher.py configs/smollm2-135m-quality.yaml \
        run.name=q1-vocab-full vocab.draft_vocab_size=full --batches 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import load_config  # noqa: E402
from eagle3.runs import Stage  # noqa: E402
from eagle3.shards import HiddenStates, collate  # noqa: E402
from eagle3.train import build_model, epoch_batches  # noqa: E402
from eagle3.teacher import VerifierHead, document_stats, make_teacher  # noqa: E402
from eagle3.ttt import TTTSpec, teacher_rows, ttt_forward  # noqa: E402
from eagle3.verifier import read_tensor  # noqa: E402
from eagle3.vocab import load_vocab  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as given to the stages")
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    tc = cfg.train
    data = HiddenStates(Stage(cfg, 2).dir)
    d2t, t2d = load_vocab(Stage(cfg, 3).dir)
    lm_head = read_tensor(cfg.verifier_path, "lm_head").float()
    head = VerifierHead.of(lm_head, torch.arange(len(d2t)) + d2t)
    model = build_model(cfg, d2t, t2d, lm_head)
    lengths = [data.num_tokens(i) for i in range(len(data))]
    groups = epoch_batches(lengths, list(range(len(data))), tc.batch_tokens, tc.seed, 0)
    batches = [collate([data[i] for i in g], tc.batch_tokens) for g in groups[:args.batches]]
    for b in batches:
        b.aux, b.final = b.aux.float(), b.final.float()
    tokens = sum(b.num_tokens for b in batches)
    needed = sum(int(teacher_rows(b).sum()) for b in batches)

    def timed(fn) -> float:
        fn(batches[0])  # warm-up
        start = time.perf_counter()
        for b in batches:
            fn(b)
        return time.perf_counter() - start

    if head.is_full:
        full_head(batches, head, model, TTTSpec.of(tc), tokens, timed)
        return
    cache = {id(b): document_stats(b.final, b.doc_end, teacher_rows(b), head) for b in batches}

    def teacher(b, rows: bool, cached: bool = False):
        return make_teacher(b.final, head, teacher_rows(b) if rows else None,
                            stats=cache[id(b)] if cached else None)

    def step(rows: bool, bf16: bool = False, cached: bool = False):
        def run(b):
            t = teacher(b, rows, cached)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = ttt_forward(model, b, t, TTTSpec(tc.ttt_steps, tc.step_decay))
            loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    all_rows = timed(lambda b: teacher(b, False))
    some_rows = timed(lambda b: teacher(b, True))
    cached_rows = timed(lambda b: teacher(b, True, cached=True))
    step_all, step_some = timed(step(False)), timed(step(True))
    step_bf16 = timed(step(True, bf16=True))
    step_cached = timed(step(True, bf16=True, cached=True))
    print(f"{len(batches)} batches, {tokens} tokens, teacher rows read by TTT: {needed} "
          f"({100 * needed / tokens:.1f}%), torch threads {torch.get_num_threads()}")
    print(f"teacher, every row      {all_rows:7.2f} s")
    print(f"teacher, rows read only {some_rows:7.2f} s  ({all_rows / some_rows:.2f}x)")
    print(f"training micro-batch    {tokens / step_all:7.0f} tok/s every row, "
          f"{tokens / step_some:7.0f} tok/s rows read only ({step_all / step_some:.2f}x)")
    print(f"  + bf16 autocast       {tokens / step_bf16:7.0f} tok/s "
          f"({step_some / step_bf16:.2f}x over fp32)")
    print(f"teacher, cached stats   {cached_rows:7.2f} s  ({some_rows / cached_rows:.2f}x over "
          f"rows read only): epochs after the first")
    print(f"  micro-batch, bf16     {tokens / step_cached:7.0f} tok/s "
          f"({step_bf16 / step_cached:.2f}x over uncached)")


def full_head(batches, head, model, spec, tokens, timed) -> None:
    """A full head's first-epoch teacher with the statistics from a second full product (as
    before) and off the draft product (now), alone and in a bf16 micro-batch."""
    def teacher(b, second_product: bool):
        rows = teacher_rows(b)
        stats = document_stats(b.final, b.doc_end, rows, head) if second_product else None
        return make_teacher(b.final, head, rows, stats=stats)

    def step(second_product: bool):
        def run(b):
            t = teacher(b, second_product)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = ttt_forward(model, b, t, spec)
            loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    two, one = timed(lambda b: teacher(b, True)), timed(lambda b: teacher(b, False))
    step_two, step_one = timed(step(True)), timed(step(False))
    print(f"{len(batches)} batches, {tokens} tokens, full head {tuple(head.full.shape)}, "
          f"loss {spec.loss}, torch threads {torch.get_num_threads()}")
    print(f"teacher, two full products  {two:7.2f} s   micro-batch bf16 {step_two:7.2f} s "
          f"({tokens / step_two:5.0f} tok/s)")
    print(f"teacher, one full product   {one:7.2f} s   micro-batch bf16 {step_one:7.2f} s "
          f"({tokens / step_one:5.0f} tok/s, {step_two / step_one:.2f}x)")


if __name__ == "__main__":
    main()
