"""The reference decoder's cost per round (stage 06's `hf` engine, engine parity): drafting
against the verifier's forward, at several context lengths.

    .venv/bin/python bench/bench_reference_decoder.py [--prompt-tokens 300 1500] [--k 3]

SmolLM2-135M-Instruct in float32 (as an AVX2 CPU serves it) with a random drafter of the demo
config's shape (one Llama layer, its draft vocabulary). A random drafter accepts next to nothing,
so every round adds one token: the figures are per round, which is what acceptance divides.
Drafting reads the drafter's cache (`DecodeCache`): step 0 over the positions added since the
last round, then k - 1 steps at the last position. Before that, each round recomputed the
whole sequence k times, so drafting grew with the context (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import load_config  # noqa: E402
from eagle3.model import Eagle3DraftModel  # noqa: E402
from eagle3.reference_decoder import ReferenceDecoder  # noqa: E402
from eagle3.train import draft_model_config  # noqa: E402
from eagle3.verifier import load_text_lm, read_tensor  # noqa: E402
from eagle3.verifiers import prepare_smollm2  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-cpu.yaml"


def random_drafter(cfg, draft_vocab: int) -> Eagle3DraftModel:
    """The config's fresh drafter shape at random weights, the verifier's embedding."""
    info = cfg.verifier_info
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_model_config(cfg, info.vocab_size, draft_vocab))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(read_tensor(cfg.verifier_path, "embed"))
        model.t2d[:draft_vocab] = True
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[300, 1500])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()

    prepare_smollm2()
    cfg = load_config(CONFIG)
    verifier = load_text_lm(cfg.verifier_path, "float32", "cpu")
    dec = ReferenceDecoder(verifier, random_drafter(cfg, cfg.vocab.draft_vocab_size),
                           list(cfg.verifier_info.aux_layer_ids), [])
    spent: dict[str, list[float]] = {"verify": [], "draft": []}

    def timed(name, fn):
        def run(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            spent[name].append(time.perf_counter() - start)
            return out
        return run

    dec._verifier_step = timed("verify", dec._verifier_step)
    dec._draft = timed("draft", dec._draft)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, k={args.k}, "
          f"{args.max_tokens} new tokens")
    print("| prompt tokens | T | rounds | draft s/round | verify s/round | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for n in args.prompt_tokens:
        prompt = [1000 + i % 20000 for i in range(n)]
        for temperature in (0.0, 0.6):
            spent.update(verify=[], draft=[])
            out = dec.decode(prompt, k=args.k, temperature=temperature,
                             max_tokens=args.max_tokens, draft_sample="probabilistic")
            rounds = spent["verify"][1:]  # the first forward is the prompt's
            print(f"| {n} | {temperature} | {out.rounds} | "
                  f"{sum(spent['draft']) / len(spent['draft']):.4f} | "
                  f"{sum(rounds) / len(rounds):.4f} | {len(out.tokens) / out.seconds:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
