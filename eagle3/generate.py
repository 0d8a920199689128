"""Stage 01: the verifier regenerates every assistant turn; conversations, tokens, loss masks.

    python 01_generate_data.py configs/smollm2-135m-cpu.yaml [generate.engine=vllm ...]
    python 01_generate_data.py configs/kimi-k2.5.yaml generate.server_urls=[http://n1:8000,...]

Prompts come from eagle3.data (sources, formats, filters, selection). Each conversation
keeps its system and user turns; the verifier answers user turn 1, then user turn 2 given its
own answer 1, and so on (never the original answers). Engines (`generate.engine`):

- `hf`: transformers in-process; conversations in fixed, length-sorted units of
  `generate.chunk_size`, each regenerated turn by turn in left-padded batches capped by
  `batch_size` and the `batch_tokens` budget. Sampling is seeded per unit.
- `vllm` / `sglang`: OpenAI-compatible servers, either started here through eagle3.engines
  (and always stopped) or given as `generate.server_urls` (several = data parallelism).
  `generate.concurrency` conversations in flight per server, retries with backoff, a timeout
  per request. Sampling is seeded per row and turn, so results do not depend on scheduling.

Resume: each finished conversation is appended as one JSON line to `01_data/shards/` (a new
shard file per run, rotated every `generate.shard_rows`). A rerun after kill -9 discards a
partial trailing line, skips finished rows and regenerates the rest; hf units are fixed by the
prompt set, so the result equals an uninterrupted run's. Conversations whose requests still
fail after all retries are not recorded: the stage then stops with an error and a rerun retries
only those. The merge writes, under `01_data/`:

- `conversations.jsonl`: {id, source, messages, sampling, turns, finish_reason, ...}
- `skipped.jsonl`: {id, source, kind, reason} for rows left out by design (source rows that are
  not a prompt, too long, no assistant token, ...)
- `errors.jsonl`: the same for what went wrong (a template that fails, an engine that refuses
  a request, an empty answer)
- `dataset/`: `datasets` Arrow dataset, columns id (string), input_ids (int32), loss_mask (int8)
- `manifest.json` (last): summary statistics, sources, sampling, config.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from eagle3.cpu import verifier_leaves_this_cpu_free
from eagle3.data import (ChatTemplateError, NonPrefixTemplateError, PromptSet,
                         conversation_samples, load_prompts, render, split_reasoning)
from eagle3.engines import ChatClient, RequestRejected, TransientError, start_server
from eagle3.runs import (Stage, StageError, atomic_dir, atomic_write_json, atomic_write_text,
                         clean_stale_tmp, config_changes, depends_on, file_records)
from eagle3.verifier import load_text_lm, load_tokenizer, stop_token_ids

log = logging.getLogger("eagle3")

SHARDS = "shards"
CONVERSATIONS = "conversations.jsonl"
ERRORS = "errors.jsonl"
SKIPPED = "skipped.jsonl"
DATASET = "dataset"
PLAN = "plan.json"
LOG_EVERY_S = 30.0
FSYNC_EVERY_S = 5.0
DATASET_BATCH_ROWS = 1024

def sampling_params(stage: Stage) -> dict[str, Any]:
    """Sampling settings shared by all rows (each row records its own seed)."""
    g = stage.cfg.generate
    greedy = g.temperature == 0
    return {"temperature": g.temperature, "top_p": 1.0 if greedy else g.top_p,
            "max_new_tokens": g.max_new_tokens}


def row_seed(seed: int, row_id: str) -> int:
    """A per-row sampling seed that does not depend on which server or when the row runs."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:4], "big") >> 1


# ---------------------------------------------------------------------------------------------
# Append-only shards


def read_shards(shard_dir: Path) -> dict[str, dict[str, Any]]:
    """Finished rows of all shards by id. A partial last line (a writer killed mid-line) is cut
    off the file, never parsed."""
    rows: dict[str, dict[str, Any]] = {}
    if not shard_dir.is_dir():
        return rows
    for path in sorted(shard_dir.glob("shard-*.jsonl")):
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: discarding a partial last line (%d bytes) left by a killed run",
                        path, len(data) - end)
            with open(path, "r+b") as f:
                f.truncate(end)
        for lineno, line in enumerate(data[:end].decode("utf-8", errors="replace")
                                      .splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                row = None
            if line.strip() and not (isinstance(row, dict) and "id" in row):
                # Damage after the write: the row is regenerated, the rest kept.
                log.warning("%s:%d is damaged; that conversation is regenerated", path, lineno)
                continue
            if row is not None:
                rows.setdefault(row["id"], row)
    return rows


class ShardWriter:
    """Appends rows as JSON lines to a new shard file of this run, rotating every `max_rows`."""

    def __init__(self, shard_dir: Path, max_rows: int) -> None:
        self.dir = shard_dir
        self.max_rows = max_rows
        shard_dir.mkdir(parents=True, exist_ok=True)
        existing = [int(p.stem.split("-")[1]) for p in shard_dir.glob("shard-*.jsonl")]
        self.index = max(existing, default=-1) + 1
        self.file: Any = None
        self.rows_in_file = 0
        self.last_sync = time.time()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if self.file is None or self.rows_in_file >= self.max_rows:
                self._open_next()
            self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.rows_in_file += 1
        if self.file is not None:
            # flush: a killed process loses nothing written; fsync now and then: a machine
            # crash loses at most a few seconds.
            self.file.flush()
            if time.time() - self.last_sync > FSYNC_EVERY_S:
                os.fsync(self.file.fileno())
                self.last_sync = time.time()

    def _open_next(self) -> None:
        self.close()
        self.file = open(self.dir / f"shard-{self.index:05d}.jsonl", "a", encoding="utf-8")
        self.index += 1
        self.rows_in_file = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None


class Progress:
    """Rows and generated tokens per second: a tqdm bar on a terminal, a log line every 30 s."""

    def __init__(self, total: int, initial: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="row", disable=None,
                        desc="stage 01", dynamic_ncols=True)
        self.t0 = self.last_log = time.time()
        self.rows = self.tokens = 0
        self.total, self.initial = total, initial

    def begin(self) -> None:
        """Start the clock when the engine is ready (model loaded, servers healthy), so rates
        measure generation, not startup."""
        self.t0 = self.last_log = time.time()

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        dt = max(time.time() - self.t0, 1e-9)
        self.bar.update(rows)
        self.bar.set_postfix_str(f"{self.rows / dt:.2f} rows/s, {self.tokens / dt:.1f} tok/s",
                                 refresh=False)
        if time.time() - self.last_log > LOG_EVERY_S:
            self.last_log = time.time()
            log.info("stage 01: %d/%d rows, %.2f rows/s, %.1f generated tokens/s",
                     self.initial + self.rows, self.total, self.rows / dt, self.tokens / dt)

    def close(self) -> dict[str, float]:
        self.bar.close()
        dt = max(time.time() - self.t0, 1e-9)
        return {"rows": self.rows, "generated_tokens": self.tokens, "seconds": round(dt, 2),
                "rows_per_s": round(self.rows / dt, 3),
                "tokens_per_s": round(self.tokens / dt, 2)}


# ---------------------------------------------------------------------------------------------
# One conversation being regenerated (shared by all engines)


@dataclass
class Conversation:
    id: str
    source: str
    prompts: list[dict[str, str]]
    """System (optional) and user turns, in order."""
    seed: Optional[int] = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[tuple[str, str]] = None
    stopped: Optional[str] = None
    next_user: int = 0

    def __post_init__(self) -> None:
        self.users = [m for m in self.prompts if m["role"] == "user"]
        self.messages = [dict(m) for m in self.prompts if m["role"] == "system"]

    def next_prompt(self) -> Optional[list[dict[str, Any]]]:
        """Messages for the next turn (history + next user turn), or None when finished."""
        if self.error or self.stopped or self.next_user >= len(self.users):
            return None
        return self.messages + [dict(self.users[self.next_user])]

    def prompt_too_long(self, n_tokens: int, max_seq_len: int) -> None:
        if self.next_user == 0:
            self.error = ("too_long_prompt", f"prompt has {n_tokens} tokens, data.max_seq_len "
                          f"is {max_seq_len}")
        else:  # keep the turns so far; the next prompt alone already fills the budget
            self.stopped = f"turn {self.next_user + 1} prompt has {n_tokens} tokens"

    def add_answer(self, content: str, reasoning: Optional[str], finish_reason: str,
                   completion_tokens: int, keep_reasoning: bool) -> None:
        self.turns.append({"finish_reason": finish_reason,
                           "completion_tokens": completion_tokens})
        if not content.strip() and not (reasoning or "").strip():
            self.error = ("empty_answer", f"the verifier's answer to user turn "
                          f"{self.next_user + 1} is empty")
            return
        answer: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning and keep_reasoning:
            answer["reasoning_content"] = reasoning
        self.messages += [dict(self.users[self.next_user]), answer]
        self.next_user += 1
        if finish_reason == "length":  # never a basis for a next turn: the verifier had not
            self.stopped = f"turn {self.next_user} cut at generate.max_new_tokens"  # finished

    def row(self, sampling: dict[str, Any], engine: str) -> dict[str, Any]:
        base = {"id": self.id, "source": self.source, "engine": engine,
                "sampling": sampling | {"seed": self.seed}}
        if self.error:
            return base | {"error_kind": self.error[0], "error": self.error[1]}
        out = base | {"messages": self.messages, "turns": self.turns,
                      "num_generated_tokens": sum(t["completion_tokens"] for t in self.turns),
                      "finish_reason": self.turns[-1]["finish_reason"]}
        if self.stopped:
            out["stopped"] = self.stopped
        return out


def _prompt_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    return tok(render(tok, messages, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# Engine hf


def _hf_device() -> str:
    """Where the hf engine generates."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_model(stage: Stage) -> tuple[Any, str]:
    cfg = stage.cfg
    device = _hf_device()
    return load_text_lm(cfg.verifier_path, cfg.verifier.dtype, device,
                        cfg.verifier.trust_remote_code), device


def budget_batches(lengths: list[int], max_rows: int, budget: int,
                   new_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges over length-sorted rows: at most `max_rows` rows and
    rows x (longest prompt + new_tokens) <= `budget` tokens (one row always fits)."""
    out, start = [], 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and end - start < max_rows and \
                (end - start + 1) * (lengths[end] + new_tokens) <= budget:
            end += 1
        out.append((start, end))
        start = end
    return out


class HFEngine:
    """The verifier in-process: batched, left-padded `generate` over length-sorted prompts."""

    def __init__(self, stage: Stage, tok: Any) -> None:
        self.cfg = stage.cfg
        self.tok = tok
        self.model, self.device = _load_model(stage)
        self.eos = stop_token_ids(tok, stage.cfg)

    def _generate(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        """(answer ids without the EOS, finish reason) per prompt of one batch."""
        import torch

        g, tok = self.cfg.generate, self.tok
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every answer starts at column `width`
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        kwargs: dict[str, Any] = {"do_sample": False}
        if g.temperature > 0:
            kwargs = {"do_sample": True, "temperature": g.temperature, "top_p": g.top_p,
                      "top_k": 0}
        with torch.no_grad():
            gen = self.model.generate(input_ids=ids.to(self.device),
                                      attention_mask=attn.to(self.device),
                                      max_new_tokens=g.max_new_tokens, eos_token_id=self.eos,
                                      pad_token_id=tok.pad_token_id, **kwargs)
        out = []
        for i in range(len(prompts)):
            answer = gen[i, width:].tolist()
            stop = next((k for k, t in enumerate(answer) if t in self.eos), None)
            out.append((answer[:stop], "stop") if stop is not None else (answer, "length"))
        return out

    def run_unit(self, convs: list[Conversation], unit_index: int) -> int:
        """Regenerate every turn of `convs`; returns the number of generated tokens."""
        import torch

        cfg, g = self.cfg, self.cfg.generate
        if g.temperature > 0:
            # One seed per unit: a resumed run regenerates a unit exactly as the first try did.
            torch.manual_seed(g.seed + unit_index)
        keep = cfg.data.thinking == "keep"
        tokens = 0
        while True:
            active: list[tuple[Conversation, list[int]]] = []
            for c in convs:
                msgs = c.next_prompt()
                if msgs is None:
                    continue
                try:
                    ids = _prompt_ids(self.tok, msgs)
                except ChatTemplateError as e:
                    c.error = ("template_error", str(e))
                    continue
                if len(ids) >= cfg.data.max_seq_len:
                    c.prompt_too_long(len(ids), cfg.data.max_seq_len)
                    continue
                active.append((c, ids))
            if not active:
                return tokens
            active.sort(key=lambda a: len(a[1]))  # stable: ties keep unit order
            lengths = [len(a[1]) for a in active]
            for start, end in budget_batches(lengths, g.batch_size, g.batch_tokens,
                                             g.max_new_tokens):
                batch = active[start:end]
                for (c, _), (answer, finish) in zip(batch, self._generate([a[1] for a in batch])):
                    text = self.tok.decode(answer, skip_special_tokens=False)
                    reasoning, content = split_reasoning(text)
                    n = len(answer) + (finish == "stop")  # the EOS is generated too
                    c.add_answer(content, reasoning, finish, n, keep)
                    tokens += n


def _run_hf(stage: Stage, tok: Any, convs: list[Conversation], done: dict[str, Any],
            emit: Callable[[list[dict[str, Any]], int], None],
            on_ready: Callable[[], None]) -> None:
    """Fixed units (length-sorted by first prompt, `chunk_size` each) over all conversations;
    a unit with any unfinished row is regenerated whole and its missing rows are emitted."""
    g = stage.cfg.generate
    sampling = sampling_params(stage)
    first_len = []
    for c in convs:
        msgs = c.next_prompt()
        try:
            first_len.append(len(_prompt_ids(tok, msgs)) if msgs else 0)
        except ChatTemplateError:
            first_len.append(0)  # reported when its unit runs
    order = sorted(range(len(convs)), key=lambda i: (first_len[i], i))
    units = [order[i:i + g.chunk_size] for i in range(0, len(order), g.chunk_size)]
    engine: Optional[HFEngine] = None
    for index, unit in enumerate(units):
        if all(convs[i].id in done for i in unit):
            continue
        if engine is None:
            engine = HFEngine(stage, tok)
            log.info("verifier loaded on %s", engine.device)
            on_ready()
        members = [convs[i] for i in unit]
        seed = g.seed + index if g.temperature > 0 else None
        for c in members:
            c.seed = seed
        tokens = engine.run_unit(members, index)
        emit([c.row(sampling, "hf") for c in members if c.id not in done], tokens)


# ---------------------------------------------------------------------------------------------
# Engines vllm / sglang


@contextlib.contextmanager
def generation_servers(stage: Stage) -> Iterator[list[str]]:
    """URLs of the servers to use: `generate.server_urls`, or one server started here (and
    always stopped on exit)."""
    cfg, g = stage.cfg, stage.cfg.generate
    if g.server_urls:
        yield list(g.server_urls)
        return
    max_len = g.server.max_model_len or cfg.data.max_seq_len + g.max_new_tokens
    with start_server(g.engine, cfg, g.server, "generate.server",
                      stage.dir / "logs" / f"{g.engine}.log", max_model_len=max_len) as server:
        yield [server.url()]


async def _regenerate(client: ChatClient, model: str, c: Conversation, stage: Stage,
                      tok: Any) -> int:
    """All turns of one conversation on one server; returns generated tokens."""
    cfg, g = stage.cfg, stage.cfg.generate
    keep = cfg.data.thinking == "keep"
    tokens = 0
    while (msgs := c.next_prompt()) is not None:
        try:
            n_prompt = len(_prompt_ids(tok, msgs))
        except ChatTemplateError as e:
            c.error = ("template_error", str(e))
            return tokens
        if n_prompt >= cfg.data.max_seq_len:
            c.prompt_too_long(n_prompt, cfg.data.max_seq_len)
            return tokens
        payload: dict[str, Any] = {"model": model, "messages": msgs,
                                   "max_tokens": g.max_new_tokens,
                                   "temperature": g.temperature,
                                   "top_p": 1.0 if g.temperature == 0 else g.top_p}
        if c.seed is not None:
            payload["seed"] = c.seed + c.next_user  # one seed per turn, fixed by the row
        try:
            reply = await client.chat(payload)
        except RequestRejected as e:
            c.error = ("engine_rejected", str(e))
            return tokens
        n = reply["completion_tokens"]
        if n is None:  # a server without usage: count with the verifier's tokenizer
            n = len(tok((reply["reasoning"] or "") + reply["content"],
                        add_special_tokens=False)["input_ids"])
        c.add_answer(reply["content"], reply["reasoning"], reply["finish_reason"], n, keep)
        tokens += n
    return tokens


async def _serve_all(stage: Stage, tok: Any, urls: list[str], convs: list[Conversation],
                     emit: Callable[[list[dict[str, Any]], int], None],
                     on_ready: Callable[[], None]) -> list[str]:
    """Regenerate `convs` on all servers (`concurrency` workers each pulling from one queue, so
    faster servers take more); returns one message per conversation that failed for good."""
    import httpx

    g = stage.cfg.generate
    sampling = sampling_params(stage)
    limits = httpx.Limits(max_connections=g.concurrency * len(urls),
                          max_keepalive_connections=g.concurrency * len(urls))
    failed: list[str] = []
    async with httpx.AsyncClient(limits=limits) as http:
        clients = [ChatClient(u, http, g.server, g.max_retries, g.retry_backoff_s)
                   for u in urls]
        models = []
        for client in clients:
            try:
                models.append(g.model_name or await client.model_name())
            except (TransientError, RequestRejected) as e:
                raise StageError(f"server {client.url} is not usable ({e}); check "
                                 f"generate.server_urls") from None
        log.info("regenerating %d conversations on %d server(s): %s", len(convs), len(urls),
                 ", ".join(urls))
        on_ready()
        queue: asyncio.Queue[Conversation] = asyncio.Queue()
        for c in convs:
            queue.put_nowait(c)

        async def worker(client: ChatClient, model: str) -> None:
            while not queue.empty():
                c = queue.get_nowait()
                try:
                    tokens = await _regenerate(client, model, c, stage, tok)
                except TransientError as e:
                    failed.append(f"{c.id}: {e}")
                    continue
                emit([c.row(sampling, g.engine)], tokens)

        await asyncio.gather(*(worker(client, model) for client, model in zip(clients, models)
                               for _ in range(g.concurrency)))
    return failed


# ---------------------------------------------------------------------------------------------
# Merge: tokenize, mask, filter, write, summarize


def _percentiles(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {}
    arr = np.asarray(lengths)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)} | {
        "min": int(arr.min()), "max": int(arr.max()), "mean": round(float(arr.mean()), 1)}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _check_plan(stage: Stage) -> None:
    """Refuse to append to shards made with other prompts or sampling settings (the stage's
    config keys, `eagle3.runs.STAGES[1]`)."""
    plan = depends_on(stage.cfg, 1)
    path = stage.dir / PLAN
    if path.is_file():
        changes = config_changes(json.loads(path.read_text()), plan)
        if changes:
            raise StageError(f"{stage.dir} holds rows made with another config ({changes[0]}): "
                             f"rerun with --restart to start stage 01 over")
        return
    atomic_write_json(path, plan)


def _build_dataset(ids: list[str], input_ids: list[list[int]], masks: list[list[int]]) -> Any:
    """The Arrow dataset, built in compact batches (Python int lists are ~10x larger)."""
    import pyarrow as pa
    from datasets import Dataset

    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    batches = [pa.record_batch([pa.array(ids[i:i + DATASET_BATCH_ROWS], pa.string()),
                                pa.array(input_ids[i:i + DATASET_BATCH_ROWS],
                                         pa.list_(pa.int32())),
                                pa.array(masks[i:i + DATASET_BATCH_ROWS], pa.list_(pa.int8()))],
                               schema=schema)
               for i in range(0, len(ids), DATASET_BATCH_ROWS)]
    return Dataset(pa.Table.from_batches(batches, schema=schema))


def run_generate(stage: Stage) -> None:
    """Run stage 01 for `stage.cfg`, resuming from the rows already in the shards."""
    started = time.time()
    cfg, g = stage.cfg, stage.cfg.generate
    out_dir = stage.dir
    shard_dir = out_dir / SHARDS
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out_dir)
    _check_plan(stage)

    prompts: PromptSet = load_prompts(cfg.data)
    tok = load_tokenizer(cfg, padding_side="left")
    sampling = sampling_params(stage)
    sampled_servers = g.engine != "hf" and g.temperature > 0
    convs = [Conversation(id=r["id"], source=r["source"], prompts=r["messages"],
                          seed=row_seed(g.seed, r["id"]) if sampled_servers else None)
             for r in prompts.rows]
    done = read_shards(shard_dir)
    todo = [c for c in convs if c.id not in done]
    log.info("stage 01: %d conversations, %d already in shards, %d to regenerate with %s",
             len(convs), len(convs) - len(todo), len(todo), g.engine)

    progress = Progress(total=len(convs), initial=len(convs) - len(todo))
    writer = ShardWriter(shard_dir, g.shard_rows)
    early = EarlyTokenizer(stage, tok)
    early.submit([done[c.id] for c in convs if c.id in done])
    failed: list[str] = []

    def emit(rows: list[dict[str, Any]], tokens: int) -> None:
        writer.write(rows)  # on disk before it counts as done
        for r in rows:
            done[r["id"]] = r
        early.submit(rows)
        progress.update(len(rows), tokens)

    try:
        if todo and g.engine == "hf":
            _run_hf(stage, tok, convs, done, emit, progress.begin)
        elif todo:
            with generation_servers(stage) as urls:
                failed = asyncio.run(_serve_all(stage, tok, urls, todo, emit, progress.begin))
    except BaseException:
        early.cancel()
        raise
    finally:
        writer.close()
        speed = progress.close()
    if failed:
        early.cancel()
        raise StageError(f"{len(failed)} conversations failed after {g.max_retries} retries "
                         f"(first: {failed[0][:300]}); the others are saved: rerun to retry them")
    t0 = time.time()
    tokenized = early.wait()
    if early.enabled:
        log.info("stage 01: tokenization overlapped generation; %.1f s left for it after the "
                 "last answer", time.time() - t0)
    _merge(stage, prompts, tok, convs, done, sampling, speed, started, tokenized)


# Kinds of left-out rows that mean something went wrong; every other kind is a row left out by
# design (not a prompt, too long, filtered) and is reported as skipped.
ERROR_KINDS = ("template_error", "non_prefix_template", "engine_rejected", "empty_answer",
               "unreadable")


@dataclass
class _Samples:
    ids: list[str] = field(default_factory=list)
    input_ids: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    conversations: list[dict[str, Any]] = field(default_factory=list)
    left_out: list[dict[str, Any]] = field(default_factory=list)
    """{id, source, kind, reason} of every row or sample not in the dataset."""
    truncated: int = 0
    split: int = 0


@dataclass
class _RowSamples:
    """What one finished conversation gives the dataset: its samples, or why it gives none."""
    samples: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    left_out: list[dict[str, Any]] = field(default_factory=list)
    truncated: int = 0
    split: bool = False
    conversation: Optional[dict[str, Any]] = None

    def leave_out(self, row: dict[str, Any], kind: str, reason: str,
                  sid: Optional[str] = None) -> None:
        self.left_out.append({"id": sid or row["id"], "source": row["source"], "kind": kind,
                              "reason": reason})


def _tokenize_row(stage: Stage, tok: Any, stop_ids: set[int],
                  row: dict[str, Any]) -> _RowSamples:
    """One finished conversation -> its samples (ids, masks); a pure function of the row."""
    data = stage.cfg.data
    out = _RowSamples()
    if "error" in row:
        out.leave_out(row, row["error_kind"], row["error"])
        return out
    messages, unclosed = _cut_turn(stage, row)
    if not messages:
        out.leave_out(row, "cut_at_max_new_tokens", "the only answer ended at "
                      "generate.max_new_tokens (generate.on_length=drop)")
        return out
    try:
        samples, was_split = conversation_samples(tok, messages, stop_ids,
                                                  data.split_rewritten_turns, unclosed)
    except NonPrefixTemplateError as e:
        out.leave_out(row, "non_prefix_template", str(e))
        return out
    except ChatTemplateError as e:
        out.leave_out(row, "template_error", str(e))
        return out
    out.split = was_split
    for k, (toks, mask) in enumerate(samples):
        sid = f"{row['id']}#{k}" if was_split else row["id"]
        if len(toks) > data.max_seq_len:
            if data.truncation == "drop":
                out.leave_out(row, "too_long", f"{len(toks)} tokens > data.max_seq_len="
                              f"{data.max_seq_len} (data.truncation=drop)", sid)
                continue
            toks, mask = toks[:data.max_seq_len], mask[:data.max_seq_len]
            out.truncated += 1
        if not any(mask):
            out.leave_out(row, "no_assistant_token", f"no assistant token within "
                          f"data.max_seq_len={data.max_seq_len}", sid)
            continue
        out.samples.append((sid, toks, mask))
    if out.samples:
        out.conversation = row | ({"samples": len(samples)} if was_split else {})
    return out


class EarlyTokenizer:
    """Tokenizes and masks each conversation on a thread of its own as soon as it is finished
    (and those an earlier run finished, from the start), so that tokenization overlaps
    generation: with a slow Python tokenizer it would otherwise run after the servers have
    stopped. Results are per row and order-free; the merge assembles them in prompt order.
    Only where the verifier generates elsewhere than this CPU (given servers, or a GPU;
    `cpu.verifier_leaves_this_cpu_free`): otherwise the merge tokenizes everything, as the
    thread would only take the generator's cycles. `cancel` stops it between rows, so that a
    failure is not held back behind the rows of an earlier run."""

    def __init__(self, stage: Stage, tok: Any) -> None:
        g = stage.cfg.generate
        server = None if g.engine == "hf" else "given" if g.server_urls else "started"
        self.enabled = verifier_leaves_this_cpu_free(server, _hf_device())
        self.stage = stage
        # the event loop keeps using its own tokenizer for prompt lengths
        self.tok = copy.deepcopy(tok) if self.enabled else tok
        self.stop_ids = set(stop_token_ids(tok, stage.cfg))
        self.results: dict[str, _RowSamples] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.futures: list[concurrent.futures.Future] = []
        self.cancelled = threading.Event()

    def submit(self, rows: list[dict[str, Any]]) -> None:
        if self.enabled:
            self.futures.append(self.pool.submit(self._run, rows))

    def _run(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if self.cancelled.is_set():
                return
            self.results[row["id"]] = _tokenize_row(self.stage, self.tok, self.stop_ids, row)

    def wait(self) -> dict[str, _RowSamples]:
        """Every submitted row's result; an unexpected error of the thread is raised here."""
        self.pool.shutdown(wait=True)
        for f in self.futures:
            f.result()
        return self.results

    def cancel(self) -> None:
        self.cancelled.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _tokenize_rows(stage: Stage, tok: Any, convs: list[Conversation],
                   done: dict[str, dict[str, Any]], out: _Samples,
                   early: Optional[dict[str, _RowSamples]] = None) -> None:
    """Every finished conversation -> samples (ids, masks), in prompt order; `early` holds the
    rows EarlyTokenizer already did."""
    stop_ids = set(stop_token_ids(tok, stage.cfg))
    early = early or {}
    for c in convs:
        row = done[c.id]
        res = early.get(c.id) or _tokenize_row(stage, tok, stop_ids, row)
        out.left_out += res.left_out
        out.truncated += res.truncated
        out.split += res.split
        for sid, toks, mask in res.samples:
            out.ids.append(sid)
            out.input_ids.append(toks)
            out.masks.append(mask)
        if res.conversation is not None:
            out.conversations.append(res.conversation)


def _cut_turn(stage: Stage, row: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """(messages to train on, whether the last turn is unclosed) of a row whose last answer
    may have ended at the length limit (`generate.on_length`)."""
    messages = row["messages"]
    if row["turns"][-1]["finish_reason"] != "length":
        return messages, False
    if stage.cfg.generate.on_length == "keep_unclosed":
        return messages, True
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    kept = messages[:last_user]
    return (kept if any(m["role"] == "assistant" for m in kept) else []), False


def _count(items: list[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item[key]] = out.get(item[key], 0) + 1
    return out


def _summary(stage: Stage, convs: list[Conversation], s: _Samples, errors: list[dict[str, Any]],
             skipped: list[dict[str, Any]]) -> dict[str, Any]:
    data = stage.cfg.data
    lengths = [len(x) for x in s.input_ids]
    tokens, assistant = sum(lengths), sum(sum(m) for m in s.masks)
    return {
        "prompts": len(convs), "rows": len(s.conversations), "samples": len(s.ids),
        "skipped": len(skipped), "skipped_by_reason": _count(skipped, "kind"),
        "errors": len(errors), "errors_by_kind": _count(errors, "kind"),
        "tokens": tokens, "assistant_tokens": assistant,
        "assistant_fraction": round(assistant / max(tokens, 1), 4),
        "length_percentiles": _percentiles(lengths),
        "finish_reason": _count(s.conversations, "finish_reason"),
        "turns": _percentiles([len(r["turns"]) for r in s.conversations]),
        "generated_tokens": sum(r["num_generated_tokens"] for r in s.conversations),
        "truncated": s.truncated, "split_conversations": s.split,
        "truncation": data.truncation, "thinking": data.thinking}


def _merge(stage: Stage, prompts: PromptSet, tok: Any, convs: list[Conversation],
           done: dict[str, dict[str, Any]], sampling: dict[str, Any], speed: dict[str, float],
           started: float, tokenized: Optional[dict[str, _RowSamples]] = None) -> None:
    """Tokenize and mask every finished conversation, write the dataset, the row reports and
    the manifest."""
    out_dir = stage.dir
    s = _Samples(left_out=[{"id": r["id"], "source": r["source"], "kind": r["kind"],
                            "reason": r["reason"]} for r in prompts.skipped])
    _tokenize_rows(stage, tok, convs, done, s, tokenized)
    errors = [r for r in s.left_out if r["kind"] in ERROR_KINDS]
    skipped = [r for r in s.left_out if r["kind"] not in ERROR_KINDS]
    _write_jsonl(out_dir / ERRORS, errors)
    _write_jsonl(out_dir / SKIPPED, skipped)
    if not s.ids:
        raise StageError(f"stage 01 produced no usable sample ({len(skipped)} rows skipped, "
                         f"{len(errors)} errors: see {out_dir / SKIPPED} and {out_dir / ERRORS}"
                         f"); check the verifier, template and data limits")
    dataset_dir = out_dir / DATASET
    if dataset_dir.exists():
        # Left by a run killed after the rename but before the manifest: rebuilt identically.
        shutil.rmtree(dataset_dir)
    with atomic_dir(dataset_dir) as tmp:
        _build_dataset(s.ids, s.input_ids, s.masks).save_to_disk(str(tmp))
    _write_jsonl(out_dir / CONVERSATIONS, s.conversations)
    summary = _summary(stage, convs, s, errors, skipped)
    log.info("stage 01 summary: %d rows (%d samples), %d tokens, assistant fraction %.3f, "
             "lengths %s, finish %s, %d truncated (%s), %d split; skipped %s; errors %s",
             summary["rows"], summary["samples"], summary["tokens"],
             summary["assistant_fraction"], summary["length_percentiles"],
             summary["finish_reason"], s.truncated, stage.cfg.data.truncation, s.split,
             summary["skipped_by_reason"] or "none", summary["errors_by_kind"] or "none")
    stage.write_manifest(
        inputs={"sources": [src.path for src in stage.cfg.data.source_configs],
                "verifier": str(stage.cfg.verifier_path)},
        outputs={"conversations": CONVERSATIONS, "errors": ERRORS, "skipped": SKIPPED,
                 "dataset": DATASET, "shards": SHARDS},
        counts=summary, files=file_records(out_dir, [dataset_dir]), started=started,
        sampling=sampling, engine=stage.cfg.generate.engine, sources=prompts.stats,
        generation_this_run=speed)
