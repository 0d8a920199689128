"""Stage 01: the verifier answers the training prompts; conversations, tokens and loss masks.

    python 01_generate_data.py configs/smollm2-135m-cpu.yaml [generate.batch_size=32 ...]

The verifier runs in-process (transformers, `verifier.dtype`, CUDA when available) with batched
left-padded generation over length-sorted prompts. Work is cut into chunks of
`generate.chunk_size` prompts; each finished chunk is written atomically to
`01_data/chunks/chunk-NNNNN.jsonl` and skipped on rerun, so a crash loses at most one chunk.
Chunks are seeded by index, so a resumed run writes exactly what an uninterrupted one would.
The merge step writes, under `01_data/`:

- `conversations.jsonl`: {id, messages, sampling, num_generated_tokens, finish_reason}
- `errors.jsonl`: {id, reason, ...} for rows dropped (empty answer, too long, template error)
- `dataset/`: a `datasets` Arrow dataset with columns id, input_ids, loss_mask
- `manifest.json` (last): counts, token statistics, inputs and the resolved config.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.data import (ChatTemplateError, load_sharegpt_prompts, load_tokenizer, render,
                         tokenize_conversation)
from eagle3.runs import (Stage, StageError, atomic_dir, atomic_write_text, clean_stale_tmp)

log = logging.getLogger("eagle3")

CHUNKS = "chunks"
CONVERSATIONS = "conversations.jsonl"
ERRORS = "errors.jsonl"
DATASET = "dataset"


def chunk_path(stage_dir: Path, index: int) -> Path:
    return stage_dir / CHUNKS / f"chunk-{index:05d}.jsonl"


def sampling_params(stage: Stage) -> dict[str, Any]:
    g = stage.cfg.generate
    greedy = g.temperature == 0
    return {"temperature": g.temperature, "top_p": 1.0 if greedy else g.top_p,
            "max_new_tokens": g.max_new_tokens, "seed": None if greedy else g.seed}


def build_messages(system_prompt: str | None, prompt: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": prompt}]


def _eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """Ids that end generation: the tokenizer's EOS plus the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list):
        ids.update(gen_eos)
    return sorted(ids)


def _load_model(stage: Stage) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = stage.cfg
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        cfg.verifier_path, dtype=getattr(torch, cfg.verifier.dtype),
        trust_remote_code=cfg.verifier.trust_remote_code).to(device)
    model.eval()
    return model, device


def _generate_chunk(stage: Stage, model: Any, device: str, tok: Any,
                    rows: list[dict[str, Any]], chunk_index: int) -> list[dict[str, Any]]:
    """Answer one chunk of prompts (already length-sorted); one output row per prompt."""
    import torch

    cfg = stage.cfg
    g = cfg.generate
    params = sampling_params(stage)
    eos = _eos_ids(tok, model)
    # One seed per chunk: a resumed run regenerates a chunk exactly as the first attempt would.
    torch.manual_seed(g.seed + chunk_index)
    out: list[dict[str, Any]] = []
    for b in range(0, len(rows), g.batch_size):
        batch = rows[b:b + g.batch_size]
        t0 = time.time()
        width = max(len(r["prompt_ids"]) for r in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every answer starts at column `width`
            n = len(r["prompt_ids"])
            ids[i, width - n:] = torch.tensor(r["prompt_ids"])
            attn[i, width - n:] = 1
        kwargs: dict[str, Any] = {"do_sample": False}
        if g.temperature > 0:
            kwargs = {"do_sample": True, "temperature": g.temperature, "top_p": g.top_p,
                      "top_k": 0}
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                 max_new_tokens=g.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, **kwargs)
        new_tokens = 0
        for i, r in enumerate(batch):
            answer = gen[i, width:].tolist()
            stop = next((k for k, t in enumerate(answer) if t in eos), None)
            finish = "stop" if stop is not None else "length"
            answer = answer[:stop] if stop is not None else answer  # strip the trailing EOS
            new_tokens += len(answer) + (stop is not None)
            text = tok.decode(answer, skip_special_tokens=False)
            messages = r["messages"] + [{"role": "assistant", "content": text}]
            row = {"id": r["id"], "messages": messages, "sampling": params,
                   "num_generated_tokens": len(answer), "finish_reason": finish}
            if not text.strip():
                row["error"] = "empty answer"
            out.append(row)
        dt = max(time.time() - t0, 1e-9)
        log.info("chunk %d: batch %d/%d, %.2f rows/s, %.1f tokens/s", chunk_index,
                 b // g.batch_size + 1, -(-len(rows) // g.batch_size), len(batch) / dt,
                 new_tokens / dt)
    return out


def _read_chunk(path: Path, expected_ids: list[str], params: dict[str, Any]) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if [r["id"] for r in rows] != expected_ids or any(
            r.get("sampling", params) != params for r in rows):
        raise StageError(f"{path} was made with other prompts or sampling settings: rerun with "
                         f"--restart to start stage 01 over")
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _percentiles(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {}
    arr = np.asarray(lengths)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)} | {
        "min": int(arr.min()), "max": int(arr.max()), "mean": round(float(arr.mean()), 1)}


def run_generate(stage: Stage) -> None:
    """Run stage 01 for `stage.cfg`, resuming from finished chunks."""
    started = time.time()
    cfg = stage.cfg
    out_dir = stage.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out_dir)
    clean_stale_tmp(out_dir / CHUNKS)

    prompts = load_sharegpt_prompts(cfg.data)
    tok = load_tokenizer(cfg, padding_side="left")
    params = sampling_params(stage)

    # Render and measure every prompt once; too-long or unrenderable prompts are errors now,
    # before any generation time is spent on them.
    todo: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for order, p in enumerate(prompts):
        messages = build_messages(cfg.data.system_prompt, p["prompt"])
        try:
            text = render(tok, messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            errors.append({"id": p["id"], "reason": f"template error: {e}"})
            continue
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) >= cfg.data.max_seq_len:
            errors.append({"id": p["id"], "reason": f"too long: prompt has {len(prompt_ids)} "
                           f"tokens, data.max_seq_len is {cfg.data.max_seq_len}"})
            continue
        todo.append({"id": p["id"], "order": order, "messages": messages,
                     "prompt_ids": prompt_ids})
    # Length-sorted chunks keep padding low; ties broken by prompt order, so it is stable.
    todo.sort(key=lambda r: (len(r["prompt_ids"]), r["order"]))
    size = cfg.generate.chunk_size
    chunks = [todo[i:i + size] for i in range(0, len(todo), size)]

    model = device = None
    generated: dict[str, dict[str, Any]] = {}
    t0, new_tokens, done_rows = time.time(), 0, 0
    for index, rows in enumerate(chunks):
        path = chunk_path(out_dir, index)
        if path.is_file():
            for r in _read_chunk(path, [r["id"] for r in rows], params):
                generated[r["id"]] = r
            continue
        if model is None:
            model, device = _load_model(stage)
            log.info("verifier loaded on %s; %d of %d chunks to generate", device,
                     sum(not chunk_path(out_dir, k).is_file() for k in range(len(chunks))),
                     len(chunks))
        out = _generate_chunk(stage, model, device, tok, rows, index)
        _write_jsonl(path, out)
        for r in out:
            generated[r["id"]] = r
        done_rows += len(out)
        new_tokens += sum(r["num_generated_tokens"] for r in out)
        dt = max(time.time() - t0, 1e-9)
        log.info("chunk %d/%d written: %.2f rows/s, %.1f tokens/s overall", index + 1,
                 len(chunks), done_rows / dt, new_tokens / dt)
    gen_seconds = time.time() - t0

    # Merge in prompt order, tokenize with the verifier's template, split off the failures.
    conversations, ids, input_ids, loss_masks = [], [], [], []
    for p in prompts:
        row = generated.get(p["id"])
        if row is None:
            continue  # already in `errors`
        if "error" in row:
            errors.append({"id": row["id"], "reason": row["error"],
                           "finish_reason": row["finish_reason"]})
            continue
        try:
            toks, mask = tokenize_conversation(tok, row["messages"], cfg.data.max_seq_len)
        except ChatTemplateError as e:
            errors.append({"id": row["id"], "reason": f"template error: {e}"})
            continue
        if not any(mask):
            errors.append({"id": row["id"], "reason": f"too long: no assistant token within "
                           f"data.max_seq_len={cfg.data.max_seq_len}"})
            continue
        conversations.append(row)
        ids.append(row["id"])
        input_ids.append(toks)
        loss_masks.append(mask)
    order = {p["id"]: k for k, p in enumerate(prompts)}
    errors.sort(key=lambda e: order[e["id"]])
    if not conversations:
        _write_jsonl(out_dir / ERRORS, errors)
        raise StageError(f"stage 01 produced no usable conversation ({len(errors)} errors, see "
                         f"{out_dir / ERRORS}); check the verifier, template and data limits")

    from datasets import Dataset, Features, Sequence, Value

    features = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                         "loss_mask": Sequence(Value("int8"))})
    ds = Dataset.from_dict({"id": ids, "input_ids": input_ids, "loss_mask": loss_masks},
                           features=features)
    dataset_dir = out_dir / DATASET
    if dataset_dir.exists():
        # Left by a run killed after the rename but before the manifest: rebuilt identically.
        shutil.rmtree(dataset_dir)
    with atomic_dir(dataset_dir) as tmp:
        ds.save_to_disk(str(tmp))
    _write_jsonl(out_dir / CONVERSATIONS, conversations)
    _write_jsonl(out_dir / ERRORS, errors)

    lengths = [len(x) for x in input_ids]
    tokens = sum(lengths)
    assistant = sum(sum(m) for m in loss_masks)
    finish = {k: sum(r["finish_reason"] == k for r in conversations) for k in ("stop", "length")}
    summary = {"prompts": len(prompts), "rows": len(conversations), "errors": len(errors),
               "tokens": tokens, "assistant_tokens": assistant,
               "assistant_fraction": round(assistant / max(tokens, 1), 4),
               "finish_reason": finish, "length_percentiles": _percentiles(lengths),
               "generated_tokens": sum(r["num_generated_tokens"] for r in conversations)}
    log.info("stage 01 summary: %d rows, %d errors, %d tokens, assistant fraction %.3f, "
             "lengths %s, finish %s", summary["rows"], summary["errors"], tokens,
             summary["assistant_fraction"], summary["length_percentiles"], finish)
    stage.write_manifest(
        inputs={"sources": list(cfg.data.sources), "verifier": str(cfg.verifier_path)},
        outputs={"conversations": CONVERSATIONS, "errors": ERRORS, "dataset": DATASET,
                 "chunks": len(chunks)},
        counts=summary, started=started, sampling=params,
        generation_seconds_this_run=round(gen_seconds, 2))
