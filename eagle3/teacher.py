"""The verifier's next-token view of each training position (the TTT teacher), and its memo.

The loss needs, per supervised position, the verifier's logits over the draft vocabulary and
two things only the full vocabulary gives: the argmax (is the target in the draft vocabulary?)
and the log-normalizer (p restricted to the draft vocabulary, unrenormalized, for the LK losses
and the sampled estimates). The full-vocabulary product is 5x the draft one at Kimi-K2.5's shape
(163,840 vs 32,000 rows) and its result never changes, so `TeacherCache` computes it once per
sample and every later epoch reads the argmax and normalizer back:

    head = VerifierHead.of(lm_head, draft_ids)
    stats = document_stats(batch.final, batch.doc_end, needed, head, keys=keys, cache=cache)
    teacher = make_teacher(batch.final, head, needed, stats=stats)

A full draft vocabulary (`VerifierHead.is_full`) needs neither: its draft product is the full
product, so `make_teacher` reads the statistics off the logits it computes anyway (before, the
first epoch of a 49,152-row head computed that product twice: bench/RESULTS.md "One product
for a full head").

Both statistics are computed per document (never across the documents packed beside it) so a
cached value is bit-for-bit the value a recomputation would give, whichever micro-batch, epoch,
rank (on the same hardware) or resumed process asks: the cache changes timing, never a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple, Optional

import torch

from eagle3 import dist


@dataclass
class Teacher:
    """Per position of a packed batch: draft-vocabulary logits, full-vocabulary argmax and
    log-normalizer (p restricted to the draft vocabulary is exp(draft_logits - lse)), also at
    the estimate's temperature."""
    draft_logits: torch.Tensor  # [1, T, Vd]
    argmax: torch.Tensor        # [1, T] target ids
    lse: torch.Tensor           # [1, T] logsumexp of the full-vocabulary logits
    lse_t: Optional[torch.Tensor] = None  # [1, T] the same of logits / temperature


@dataclass
class VerifierHead:
    """The verifier's output head in fp32, whole and as its draft-vocabulary rows (gathered
    once: at Kimi's shape the gather alone copies 0.9 GB; a full draft vocabulary's rows are
    the head itself, 4.7 GB not copied)."""
    full: torch.Tensor   # [V, H]
    draft: torch.Tensor  # [Vd, H] = full[draft_ids]

    @classmethod
    def of(cls, lm_head: torch.Tensor, draft_ids: torch.Tensor) -> "VerifierHead":
        full = lm_head.float()
        draft_ids = draft_ids.to(full.device)
        if torch.equal(draft_ids, torch.arange(full.shape[0], device=full.device)):
            return cls(full, full)
        return cls(full, full[draft_ids].contiguous())

    @property
    def is_full(self) -> bool:
        """The draft vocabulary is the whole vocabulary, in order: draft logits are full logits."""
        return self.draft is self.full


class FullStats(NamedTuple):
    """Full-vocabulary statistics of some rows, in row order."""
    argmax: torch.Tensor           # [n] long
    lse: torch.Tensor              # [n] float32
    lse_t: Optional[torch.Tensor]  # [n] float32 at the estimate's temperature, or None

    @staticmethod
    def zeros(n: int, device: torch.device, temperature: Optional[float]) -> "FullStats":
        """n rows to fill, with `lse_t` where there is an estimate temperature."""
        return FullStats(torch.zeros(n, dtype=torch.long, device=device),
                         torch.zeros(n, dtype=torch.float32, device=device),
                         torch.zeros(n, dtype=torch.float32, device=device)
                         if temperature else None)

    def to(self, device: torch.device) -> "FullStats":
        return FullStats(*(None if x is None else x.to(device) for x in self))

    @staticmethod
    def cat(parts: list["FullStats"]) -> "FullStats":
        return FullStats(*(None if parts[0][i] is None else torch.cat([p[i] for p in parts])
                           for i in range(3)))


@torch.no_grad()
def full_vocab_stats(states: torch.Tensor, head: VerifierHead,
                     temperature: Optional[float] = None, chunk: int = 1024) -> FullStats:
    """Argmax and logsumexp (and logsumexp of logits / T) of `states` [n, H] @ the full head,
    `chunk` rows at a time so no more than chunk x V logits exist at once."""
    n = states.shape[0]
    out = FullStats.zeros(n, states.device, temperature)
    for i in range(0, n, chunk):
        _write_stats(out, slice(i, i + chunk), states[i:i + chunk].float() @ head.full.T,
                     temperature)
    return out


def _write_stats(out: FullStats, rows: torch.Tensor | slice, full: torch.Tensor,
                 temperature: Optional[float]) -> None:
    """`out`'s `rows` from those rows' full-vocabulary logits [n, V]."""
    out.argmax[rows] = full.argmax(-1)
    out.lse[rows] = full.logsumexp(-1)
    if out.lse_t is not None:
        out.lse_t[rows] = (full / temperature).logsumexp(-1)


class TeacherCache:
    """Each sample's `FullStats` (under one key: sample, supervised rows, temperature), computed
    the first time it is asked for. Stored on the CPU at 12 bytes per supervised token (120 MB
    for 10M tokens). Under several processes each computes the samples of its own micro-batches;
    `share` (a collective, at each epoch end) gives every process the others' new entries, since
    the next epoch deals the samples out differently."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, FullStats] = {}
        self.fresh: dict[Hashable, FullStats] = {}

    def get(self, key: Hashable, states: torch.Tensor, head: VerifierHead,
            temperature: Optional[float]) -> FullStats:
        hit = self.entries.get(key)
        if hit is not None:
            return hit.to(states.device)
        stats = full_vocab_stats(states, head, temperature)
        stored = FullStats(stats.argmax.to("cpu", torch.int32), stats.lse.cpu(),
                           None if stats.lse_t is None else stats.lse_t.cpu())
        self.entries[key] = self.fresh[key] = stored
        return stats

    def share(self) -> None:
        """All processes end with every entry any of them computed (one process: nothing)."""
        for part in dist.gather_objects(self.fresh):
            self.entries.update(part)
        self.fresh = {}
        dist.log0("teacher cache: %d samples, %.1f MB", len(self.entries), self.nbytes / 2**20)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for s in self.entries.values() for x in s
                   if x is not None)


def document_spans(doc_end: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a packed row, from its per-position document ends."""
    ends = doc_end.reshape(-1).tolist()
    spans, start = [], 0
    while start < len(ends):
        spans.append((start, ends[start]))
        start = ends[start]
    return spans


@torch.no_grad()
def document_stats(final: torch.Tensor, doc_end: torch.Tensor, needed: torch.Tensor,
                   head: VerifierHead, temperature: Optional[float] = None,
                   keys: Optional[list[Hashable]] = None,
                   cache: Optional[TeacherCache] = None) -> FullStats:
    """`FullStats` of the `needed` rows of a packed batch, computed (or, with a cache and one key
    per document, looked up) document by document."""
    flat, need = final.reshape(-1, final.shape[-1]), needed.reshape(-1)
    parts = []
    for d, (s, e) in enumerate(document_spans(doc_end)):
        states = flat[s:e][need[s:e]]
        parts.append(full_vocab_stats(states, head, temperature) if cache is None else
                     cache.get(keys[d], states, head, temperature))
    return FullStats.cat(parts)


@torch.no_grad()
def make_teacher(final: torch.Tensor, head: VerifierHead, needed: Optional[torch.Tensor] = None,
                 temperature: Optional[float] = None, stats: Optional[FullStats] = None,
                 chunk: int = 1024) -> Teacher:
    """Teacher from post-norm final states [1, T, H].

    Only rows in `needed` ([1, T] bool, default all) are filled; the others are zero and must
    never be read (prompt positions carry no loss and need no teacher). `stats` are the needed
    rows' full-vocabulary statistics (`document_stats`). When not given they are computed here
    over all needed rows at once: off the draft logits for a full head (the same product),
    else from the full head. `temperature` adds the log-normalizer at T for the sampled
    estimate. The draft-vocabulary logits are always the product with the head's draft rows."""
    flat = final.reshape(-1, final.shape[-1])
    n = flat.shape[0]
    rows = torch.arange(n, device=flat.device) if needed is None else \
        needed.reshape(-1).nonzero().squeeze(1)
    derive = stats is None and head.is_full
    if stats is None and not derive:
        stats = full_vocab_stats(flat[rows], head, temperature, chunk)
    draft = flat.new_zeros(n, head.draft.shape[0], dtype=torch.float32)
    out = FullStats.zeros(n, flat.device, temperature)
    for i in range(0, len(rows), chunk):
        r = rows[i:i + chunk]
        logits = flat[r].float() @ head.draft.T
        draft[r] = logits
        if derive:
            _write_stats(out, r, logits, temperature)
    if not derive:
        out.argmax[rows] = stats.argmax.long()
        out.lse[rows] = stats.lse
        if temperature:
            out.lse_t[rows] = stats.lse_t
    shape = final.shape[:-1]
    return Teacher(draft.view(*shape, -1), out.argmax.view(shape), out.lse.view(shape),
                   None if out.lse_t is None else out.lse_t.view(shape))
