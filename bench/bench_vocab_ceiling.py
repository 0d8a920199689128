"""What a draft vocabulary size can buy on MT-bench, before any training: the ceiling.

    .venv/bin/python bench/bench_vocab_ceiling.py CONFIG [--sizes 4096 8192 16384] [key=value ...]

At T = 0 the engine accepts a drafted token only if it is the verifier's argmax, and a drafter
can only propose ids of its draft vocabulary. So a verifier target outside the vocabulary is a
certain rejection, whatever the training. This builds the draft vocabulary of each size from
stage 01's supervised-token counts exactly as stage 03 does (`eagle3.vocab.build_vocab_map`,
end-of-turn ids forced in), has the verifier answer the first `bench.num_prompts` MT-bench
prompts greedily (`bench.max_tokens` tokens; its greedy answer tokens are its argmax targets),
and reports per size:
- coverage: the share of answer tokens inside the vocabulary (stage 03 reports the same on the
  training data);
- ceiling: the acceptance length at K drafts of a drafter that is always right inside its
  vocabulary, drafting from every answer position: mean of 1 + (in-vocabulary run of the next
  K targets). The measured engine figure sits far below it; the gap between two sizes'
  ceilings bounds what the larger vocabulary can add.
Results go to stdout and `runs/<name>/bench_vocab_ceiling.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.bench import load_mtbench_prompts  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.data import tokenize_conversation  # noqa: E402
from eagle3.runs import Stage  # noqa: E402
from eagle3.verifier import load_tokenizer, stop_token_ids  # noqa: E402
from eagle3.vocab import build_vocab_map, count_dataset, coverage  # noqa: E402


def greedy_answers(cfg, prompts: list[dict], max_tokens: int, batch: int = 16) -> list[str]:
    """The verifier's greedy answer to each prompt (HF transformers, the config's dtype)."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(cfg, padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        cfg.verifier_path, dtype=getattr(torch, cfg.verifier.dtype),
        trust_remote_code=cfg.verifier.trust_remote_code).eval()
    stops = stop_token_ids(tok, cfg)
    out = []
    for i in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
                 for p in prompts[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def ceiling(targets: list[torch.Tensor], t2d: torch.Tensor, k: int) -> tuple[float, float]:
    """(coverage of the answer tokens, mean of 1 + in-vocabulary run of the next k targets)."""
    inside = [t2d[t] for t in targets]
    runs = []
    for ok in inside:
        for s in range(len(ok)):
            n = 0
            while n < k and s + n < len(ok) and ok[s + n]:
                n += 1
            runs.append(1 + n)
    cov = float(torch.cat(inside).float().mean())
    return cov, sum(runs) / len(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as given to the stages")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_grad_enabled(False)

    counts = count_dataset(Stage(cfg, 1).dir / "dataset", cfg.verifier_info.vocab_size)
    prompts = load_mtbench_prompts(cfg.bench.num_prompts)
    answers = greedy_answers(cfg, prompts, cfg.bench.max_tokens)
    tok = load_tokenizer(cfg)
    stops = stop_token_ids(tok, cfg)
    targets = []
    for p, a in zip(prompts, answers):
        ids, mask = tokenize_conversation(tok, [*p["messages"],
                                                {"role": "assistant", "content": a}], stops)
        ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        targets.append(ids[mask][:cfg.bench.max_tokens])
    rows = {}
    for size in args.sizes:
        _, t2d = build_vocab_map(counts, size, stops)
        train_cov = coverage(counts, t2d)
        cov, ceil = ceiling(targets, t2d, args.k)
        rows[size] = {"train_coverage": round(train_cov, 5), "mtbench_coverage": round(cov, 5),
                      "ceiling_accept_len": round(ceil, 4)}
        print(f"draft vocab {size}: coverage {100 * train_cov:.2f}% of the training targets, "
              f"{100 * cov:.2f}% of the MT-bench answer tokens; ceiling at K={args.k}: "
              f"{ceil:.3f}")
    out = {"k": args.k, "prompts": len(prompts),
           "answer_tokens": int(sum(len(t) for t in targets)), "sizes": rows}
    path = Path(cfg.run.dir) / cfg.run.name / "bench_vocab_ceiling.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
