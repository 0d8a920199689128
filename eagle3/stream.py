"""Stage 04's data feed: hidden states streamed from the verifier (`hidden_states.mode: stream`),
and the producer that keeps the trainer's next micro-batches ready in both modes.

    data = open_streamed(stage, ctx, stack)   # the reader interface of eagle3.shards.HiddenStates
    producer = Producer(data.get, depth)      # fetches ahead of the trainer, bounded and timed
    producer.ahead(next_groups); samples = producer.take(group)

A streamed sample is made the way stage 02 stores one: the same capture backend
(eagle3.hidden_states.capture_backend: transformers in this process, or vLLM servers), the same
encoding to the storage dtype and decoding back (eagle3.shards.encode / decode), from the same
stage-01 tokens and masks. Nothing about the data order changes: the trainer asks for the samples
it would have read. The verifier computes a group's samples in one call, length-sorted and cut
into forwards of at most `hidden_states.batch_tokens` padded tokens; a forward's numerics depend
on what it is batched with, so a streamed sample equals its stored copy bit for bit when both
were computed alone (batch_tokens below twice the shortest sample, as in tests/test_stream.py)
and otherwise up to batching noise (measured in bench/RESULTS.md "Streamed hidden states").

Before training, the producer recomputes stage 02's reference samples (`stream_check/`, the same
group in the same call) and compares: bit-identical is reported as such, a difference within
bf16 noise is reported with its size, and a larger one (the verifier's weights changed since
stage 02, or another device or dtype) stops the stage.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from eagle3 import dist
from eagle3.runs import Stage, StageError
from eagle3.shards import INDEX, HiddenStates, IndexFacts, decode, encode

log = logging.getLogger("eagle3")

STATE_CACHE = "state_cache"
REFERENCE_TOLERANCE = 0.02
"""Largest difference from stage 02's reference states, relative to their largest magnitude, that
the producer may show (batching noise of a bf16 forward is a few bf16 steps, 2^-8 each)."""

Sample = dict[str, torch.Tensor]


class StreamedStates(IndexFacts):
    """Stage 01's samples whose hidden states the verifier computes when asked; the reader
    interface of `HiddenStates` (ids, lengths, supervised ends, `get`). Thread-safe: one group is
    captured at a time (the capture backend's hooks hold one forward's states)."""

    def __init__(self, dataset: Any, index: dict[str, Any],
                 capture: Callable[[list[str], list[list[int]]], list]) -> None:
        import numpy as np
        import pyarrow.compute as pc

        self.ds = dataset
        self.index = index
        self.ids: list[str] = list(dataset["id"])
        self._capture = capture
        self._lock = threading.Lock()
        self.cache: Optional[StateCache] = None
        self.captured_tokens = 0
        """Tokens whose states the verifier computed."""
        self.cached_tokens = 0
        """Tokens whose states were read from the cache instead."""
        self._lengths = pc.list_value_length(dataset.data.column("input_ids")).to_pylist()
        # One past each sample's last supervised token, from the flat Arrow column (a Python
        # list per sample would not fit in memory for production data sets).
        masks = dataset.data.column("loss_mask").combine_chunks()
        offsets = masks.offsets.to_numpy()
        on = np.flatnonzero(masks.values.to_numpy(zero_copy_only=False))
        rows = np.searchsorted(offsets, on, side="right") - 1
        ends = np.zeros(len(self.ids), dtype=np.int64)
        np.maximum.at(ends, rows, on - offsets[rows] + 1)
        self._supervised_end = ends.tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def num_tokens(self, i: int) -> int:
        return self._lengths[i]

    def supervised_end(self, i: int) -> int:
        return self._supervised_end[i]

    def shard_of(self, i: int) -> str:
        return f"streamed, 01_data row {i}"

    def __getitem__(self, i: int) -> Sample:
        return self.get([i])[0]

    def get(self, group: list[int]) -> list[Sample]:
        """The samples of one micro-batch: their states from the cache, or computed in one
        capture call. A group with a sample the cache should hold but does not yet (its first
        computation, or one cut short by a crash) is computed whole, as it was the first time,
        so that its numerics do not depend on where a run was interrupted."""
        from eagle3.hidden_states import check_finite

        cache = self.cache
        stored = {i: cache.read(i, self.ids[i]) for i in group if cache and cache.keeps(i)}
        if any(v is None for v in stored.values()):
            stored = {}
        todo = [i for i in group if i not in stored]
        rows = {i: self.ds[i] for i in group}
        states: dict[int, dict[str, torch.Tensor]] = {}
        if todo:
            sample_ids = [self.ids[i] for i in todo]
            with self._lock:
                captured = self._capture(sample_ids, [rows[i]["input_ids"] for i in todo])
                self.captured_tokens += sum(len(rows[i]["input_ids"]) for i in todo)
            for i, sid, (aux, final) in zip(todo, sample_ids, captured):
                check_finite(sid, "streamed", aux, final, self.index.get("verifier_dtype", "?"))
                states[i] = encode(aux, final, self.dtype, len(self.aux_layer_ids))
                if cache and cache.keeps(i):
                    cache.write(i, self.ids[i], states[i])
        states |= stored
        self.cached_tokens += sum(len(rows[i]["input_ids"]) for i in stored)
        return [decode(torch.tensor(rows[i]["input_ids"], dtype=torch.int64),
                       torch.tensor(rows[i]["loss_mask"], dtype=torch.uint8), states[i])
                for i in group]


class StateCache:
    """`hidden_states.cache_gb` of streamed states on disk, one safetensors file per sample
    (`04_train/state_cache/NNNNNNNN.safetensors`, renamed into place whole): the first samples
    of the first epoch's order whose stored bytes fit the budget. A file that is missing, cut or
    made for another sample id is recomputed."""

    def __init__(self, directory: Path, keep: set[int]) -> None:
        self.dir = directory
        self.keep = keep
        directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def plan(cls, directory: Path, order: list[int], lengths: list[int], bytes_per_token: int,
             budget_gb: float) -> "StateCache":
        keep, used = set(), 0
        for i in order:
            used += lengths[i] * bytes_per_token
            if used > budget_gb * 1e9:
                break
            keep.add(i)
        return cls(directory, keep)

    def keeps(self, i: int) -> bool:
        return i in self.keep

    def _path(self, i: int) -> Path:
        return self.dir / f"{i:08d}.safetensors"

    def read(self, i: int, sample_id: str) -> Optional[dict[str, torch.Tensor]]:
        from safetensors import safe_open

        from eagle3.runs import safetensors_header

        path = self._path(i)
        header = safetensors_header(path)
        if header is None or header.get("__metadata__", {}).get("id") != sample_id:
            return None
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def write(self, i: int, sample_id: str, states: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from eagle3.runs import atomic_path

        with atomic_path(self._path(i)) as tmp:
            save_file({k: v.contiguous() for k, v in states.items()}, str(tmp),
                      metadata={"id": sample_id})

    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("*.safetensors"))


def is_streamed(stage: Stage) -> bool:
    """Whether stage 02 (upstream of `stage`) ran in stream mode."""
    import json

    path = stage.upstream(2).dir / INDEX
    try:
        return json.loads(path.read_text()).get("mode") == "stream"
    except (OSError, ValueError):
        return False


def open_streamed(stage: Stage, ctx: dist.DistContext,
                  stack: contextlib.ExitStack) -> StreamedStates:
    """The streamed data of `stage`'s run, its capture backend held open by `stack`, checked
    against stage 02's reference samples."""
    import json

    from datasets import load_from_disk

    from eagle3.hidden_states import STREAM_CHECK_DIR, capture_backend

    hs_dir = stage.upstream(2).dir
    index = json.loads((hs_dir / INDEX).read_text())
    index["verifier_dtype"] = stage.cfg.verifier.dtype
    ds = load_from_disk(str(stage.upstream(1).dir / "dataset"))
    if len(ds) != index["num_samples"]:
        raise StageError(f"01_data has {len(ds)} samples but 02_hidden_states streamed "
                         f"{index['num_samples']}: rerun `{stage.upstream(2).command()}`")
    capture = stack.enter_context(capture_backend(stage.upstream(2), ctx, _longest(ds)))
    data = StreamedStates(ds, index, capture)
    check_reference(data, HiddenStates(hs_dir / STREAM_CHECK_DIR,
                                       stage.upstream(2).command("--restart")))
    return data


def _longest(ds: Any) -> int:
    import pyarrow.compute as pc

    return int(pc.max(pc.list_value_length(ds.data.column("input_ids"))).as_py())


def check_reference(data: StreamedStates, reference: HiddenStates) -> dict[str, float]:
    """Recompute stage 02's reference samples through the stream and compare; returns the
    largest relative difference per tensor. Raises when it is beyond `REFERENCE_TOLERANCE`."""
    if reference.ids != data.ids[:len(reference)]:
        raise StageError("02_hidden_states/stream_check holds other samples than 01_data's "
                         "first ones: rerun stage 02 with --restart")
    group = list(range(len(reference)))
    streamed = data.get(group)
    worst = {"aux": 0.0, "final": 0.0}
    for i, got in zip(group, streamed):
        want = reference[i]
        if not (torch.equal(got["input_ids"], want["input_ids"])
                and torch.equal(got["loss_mask"], want["loss_mask"])):
            raise StageError(f"sample {data.ids[i]}: 01_data's tokens differ from stage 02's "
                             f"reference: rerun stage 02 with --restart")
        for name in worst:
            a, b = got[name].float(), want[name].float()
            scale = max(float(b.abs().max()), 1e-12)
            worst[name] = max(worst[name], float((a - b).abs().max()) / scale)
    if max(worst.values()) > REFERENCE_TOLERANCE:
        raise StageError(
            f"the verifier's streamed states differ from stage 02's reference by up to "
            f"{max(worst.values()):.3g} of their magnitude (aux {worst['aux']:.3g}, final "
            f"{worst['final']:.3g}; allowed {REFERENCE_TOLERANCE}): its weights changed since "
            f"stage 02, or it runs on another device or dtype; rerun stage 02 with --restart")
    if max(worst.values()) == 0:
        dist.log0("stream check: %d reference samples reproduced bit for bit", len(group))
    else:
        dist.log0("stream check: %d reference samples reproduced within %.3g (aux) and %.3g "
                  "(final) of their magnitude: batching or device numerics", len(group),
                  worst["aux"], worst["final"])
    return worst


class Producer:
    """Fetches the samples of the micro-batches this rank trains on next, in one background
    thread, ahead of the trainer: at most `depth` micro-batches exist at a time (fetched or being
    fetched, not yet taken), which bounds the memory streamed states take. Fetches are pure, so
    nothing changes but the wait. Times both sides for `window`: how long the trainer waited,
    how long the producer worked, and the tokens it delivered."""

    def __init__(self, fetch: Callable[[list[int]], list[Sample]], depth: int) -> None:
        self.fetch, self.depth = fetch, depth
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="producer")
        self.pending: dict[tuple[int, ...], concurrent.futures.Future] = {}
        self.max_pending = 0
        self._waited = self._busy = 0.0
        self._tokens = 0
        self._counter_lock = threading.Lock()

    def ahead(self, groups: list[list[int]]) -> None:
        """Queue these micro-batches (in training order) while the bound allows."""
        for group in groups:
            key = tuple(group)
            if key in self.pending:
                continue
            if len(self.pending) >= self.depth:
                break
            self.pending[key] = self.pool.submit(self._timed_fetch, group)
            self.max_pending = max(self.max_pending, len(self.pending))

    def _timed_fetch(self, group: list[int]) -> list[Sample]:
        started = time.perf_counter()
        samples = self.fetch(group)
        with self._counter_lock:
            self._busy += time.perf_counter() - started
            self._tokens += sum(len(s["input_ids"]) for s in samples)
        return samples

    def take(self, group: list[int]) -> Optional[list[Sample]]:
        """The samples of `group` if it was queued (waiting for them if needed), else None."""
        future = self.pending.pop(tuple(group), None)
        if future is None:
            return None
        started = time.perf_counter()
        samples = future.result()
        self._waited += time.perf_counter() - started
        return samples

    def window(self) -> dict[str, float]:
        """Seconds the trainer waited and the producer worked, and tokens delivered, since the
        last call."""
        with self._counter_lock:
            out = {"waited_s": self._waited, "producer_busy_s": self._busy,
                   "producer_tokens": self._tokens}
            self._waited = self._busy = 0.0
            self._tokens = 0
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
