"""Stage 01's merge (tokenize + mask every conversation) at a large vocabulary: the end-of-turn
ids looked up once per stage (now) vs once per conversation (before issue 15).

    .venv/bin/python bench/bench_merge.py [--conversations 200] [--vocab 262144]

The tokenizer is SmolLM2's grown to `--vocab` entries with added tokens (a Gemma-3-sized
vocabulary: `get_vocab()` then builds a 262k-entry dict, 0.2-0.3 s a call); the conversations
are ShareGPT first turns with their own text as the answer. Both ways produce identical samples
(checked); the figure is seconds per conversation and the extrapolation to 100k.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import DataConfig  # noqa: E402
from eagle3.data import conversation_samples, load_prompts  # noqa: E402
from eagle3.verifier import stop_token_ids  # noqa: E402
from eagle3.verifiers import prepare_smollm2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=262144)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    t = time.time()
    tok.add_tokens([f"<extra_{i}>" for i in range(args.vocab - len(tok))])
    print(f"tokenizer grown to {len(tok)} entries in {time.time() - t:.1f} s")
    rows = load_prompts(DataConfig(num_samples=args.conversations, max_user_turns=1)).rows
    convs = [[*r["messages"], {"role": "assistant", "content": r["messages"][-1]["content"]}]
             for r in rows]

    def merge(per_conversation: bool) -> tuple[float, list]:
        out = []
        tok._eagle3_stop_ids = None
        t = time.time()
        stop = set(stop_token_ids(tok))
        for msgs in convs:
            if per_conversation:  # what the merge did before: the lookup inside the loop
                tok._eagle3_stop_ids = None
                stop = set(stop_token_ids(tok))
            out.append(conversation_samples(tok, msgs, stop, False, False)[0])
        return time.time() - t, out

    t_once, a = merge(False)
    t_each, b = merge(True)
    assert a == b, "the two ways disagree"
    n = len(convs)
    for name, secs in (("once per stage", t_once), ("once per conversation", t_each)):
        print(f"| {name} | {n} | {secs:.1f} | {secs / n * 1000:.1f} | "
              f"{secs / n * 100_000 / 3600:.2f} |")


if __name__ == "__main__":
    main()
