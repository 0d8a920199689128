"""The hidden-state shard format of stage 02: writer, reader, and the batches stage 04 packs.

One convention. Aux ids are HF `output_hidden_states` indices (0 = embeddings, j = output of
decoder layer j-1 = the residual stream entering layer j; vLLM and new SGLang use the same
numbers). The stored final state is **post final norm** (HF's `last_hidden_state`), so
`lm_head(final)` are the verifier's logits and the trainer never norms it again.

Storage (`hidden_states.dtype`): `bfloat16` (default) or `float32` for every state, or
`fp8_e4m3`: aux as float8_e4m3fn with one float32 scale per (token, aux layer) row
(`aux_scale` [N, n_aux], amax / 448), final kept bfloat16. The reader returns dequantized
floating tensors. Bytes per token = n_aux*Ht*aux_bytes + Ht*final_bytes + 4*n_aux (fp8 only)
+ 8 (token id) + 1 (mask).

Files under `02_hidden_states/`:
- `shard-NNNNN.safetensors`: consecutive dataset samples, token-concatenated: `input_ids` [N]
  int64, `loss_mask` [N] uint8, `aux` [N, n_aux*Ht], `final` [N, Ht], (`aux_scale` for fp8),
  `offsets` [samples+1] int64; metadata key `eagle3` = JSON {format, ids, aux_layer_ids,
  convention, final_state, dtype, hidden_size, verifier, backend}.
- `shard-NNNNN.json`: its index entry {file, samples, tokens, bytes, sha256}, written after
  the shard. A shard counts as done only when both exist and size, sha256, sample ids and
  facts all agree; otherwise it is redone. Shards are fsynced and renamed into place, so a
  kill -9 never leaves one that looks complete, and a redone shard is byte-identical.
- `index.json`: all entries, totals and facts (written with the manifest).

    hs = HiddenStates("runs/smollm2-135m-cpu/02_hidden_states")
    sample = hs[0]   # {"input_ids", "loss_mask", "aux" [T, n_aux*Ht], "final" [T, Ht]}
    batch = collate([hs[i] for i in group], budget)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.runs import (StageError, atomic_path, atomic_write_json, file_sha256,
                         safetensors_header)

FORMAT = "eagle3-hidden-states-v2"
INDEX = "index.json"
AUX_CONVENTION = "hf_output_hidden_states"
FINAL_STATE = "post_norm"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# storage dtype -> (aux tensor dtype, final tensor dtype)
STORAGE = {"float32": (torch.float32, torch.float32),
           "bfloat16": (torch.bfloat16, torch.bfloat16),
           "fp8_e4m3": (torch.float8_e4m3fn, torch.bfloat16)}
TENSORS = ("input_ids", "loss_mask", "aux", "final", "offsets")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def entry_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def bytes_per_token(n_aux: int, hidden: int, dtype: str) -> int:
    """Tensor bytes one token takes in a shard: states (+ fp8 scales), token id, mask."""
    aux_t, final_t = STORAGE[dtype]
    scales = 4 * n_aux if aux_t == torch.float8_e4m3fn else 0
    return n_aux * hidden * aux_t.itemsize + hidden * final_t.itemsize + scales + 8 + 1


# ---------------------------------------------------------------------------------------------
# Encoding


def quantize_fp8(aux: torch.Tensor, n_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 aux [T, n_aux*H] with one float32 scale per (token, aux layer) row."""
    x = aux.float().reshape(aux.shape[0], n_aux, -1)
    # An all-zero row keeps a tiny scale instead of 0 so that dequantization never divides.
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(aux.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n_aux = scale.shape[-1]
    x = q.float().reshape(q.shape[0], n_aux, -1) * scale[..., None]
    return x.reshape(q.shape)


def decode(input_ids: torch.Tensor, loss_mask: torch.Tensor,
           states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sample as stage 04 reads it, from its stored tensors (`encode`'s output): fp8 aux
    dequantized, the rest as stored. Stored and streamed samples both come through here."""
    aux = states["aux"]
    if aux.dtype == torch.float8_e4m3fn:
        aux = dequantize_fp8(aux, states["aux_scale"])
    return {"input_ids": input_ids.long(), "loss_mask": loss_mask.long(), "aux": aux,
            "final": states["final"]}


def encode(aux: torch.Tensor, final: torch.Tensor, dtype: str,
           n_aux: int) -> dict[str, torch.Tensor]:
    """The stored tensors of one sample's states."""
    aux_t, final_t = STORAGE[dtype]
    if aux_t == torch.float8_e4m3fn:
        q, scale = quantize_fp8(aux, n_aux)
        return {"aux": q, "aux_scale": scale, "final": final.to(final_t)}
    return {"aux": aux.to(aux_t), "final": final.to(final_t)}


# ---------------------------------------------------------------------------------------------
# Shard files


def read_shard_header(path: Path) -> dict[str, Any] | None:
    """The safetensors header of a shard, or None when the file is truncated, not a
    safetensors file, or lacks a shard tensor."""
    header = safetensors_header(path)
    if header is None or any(t not in header for t in TENSORS):
        return None
    return header


def shard_metadata(header: dict[str, Any]) -> dict[str, Any]:
    # One metadata key holding JSON: safetensors stores metadata as a map whose key order is
    # not fixed, and one key keeps shard bytes identical from run to run.
    return json.loads(header.get("__metadata__", {}).get("eagle3", "{}"))


def shard_done(out_dir: Path, k: int, ids: list[str], tokens: int,
               facts: dict[str, Any]) -> dict[str, Any] | None:
    """The index entry of shard k if the shard on disk is whole and is exactly these samples
    made with these facts (size, sha256, header, ids); None when it must be (re)done."""
    path, entry_path = out_dir / shard_name(k), out_dir / entry_name(k)
    if not (path.is_file() and entry_path.is_file()):
        return None
    try:
        entry = json.loads(entry_path.read_text())
    except ValueError:
        return None
    if not isinstance(entry, dict) or entry.get("bytes") != path.stat().st_size \
            or entry.get("samples") != len(ids) or entry.get("tokens") != tokens:
        return None
    header = read_shard_header(path)
    if header is None or header["input_ids"]["shape"] != [tokens]:
        return None
    try:
        meta = shard_metadata(header)
    except ValueError:
        return None
    if meta.get("format") != FORMAT or meta.get("ids") != ids \
            or any(meta.get(key) != v for key, v in facts.items()):
        return None
    # The hash catches damage inside the data that keeps the size (a bad copy, a bad disk).
    if file_sha256(path) != entry.get("sha256"):
        return None
    return entry


def write_shard(out_dir: Path, k: int, ids: list[str], input_ids: list[list[int]],
                loss_mask: list[list[int]], states: list[dict[str, torch.Tensor]],
                facts: dict[str, Any]) -> dict[str, Any]:
    """Write shard k (fsynced, atomically) and then its index entry; return the entry."""
    from safetensors.torch import save_file

    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "input_ids": torch.tensor([t for x in input_ids for t in x], dtype=torch.int64),
        "loss_mask": torch.tensor([m for x in loss_mask for m in x], dtype=torch.uint8),
        "offsets": offsets,
    }
    for name in states[0]:
        tensors[name] = torch.cat([s[name] for s in states]).contiguous()
    meta = {"format": FORMAT, "ids": ids, **facts}
    path = out_dir / shard_name(k)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"eagle3": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the rename must never expose bytes still in flight
        digest = file_sha256(tmp)
    entry = {"file": path.name, "samples": len(ids), "tokens": int(offsets[-1]),
             "bytes": path.stat().st_size, "sha256": digest}
    atomic_write_json(out_dir / entry_name(k), entry)
    return entry


# ---------------------------------------------------------------------------------------------
# Reader


class IndexFacts:
    """What stage 02's `index.json` says about the states, for both readers of them (stored:
    `HiddenStates`; streamed: eagle3.stream.StreamedStates)."""
    index: dict[str, Any]

    @property
    def aux_layer_ids(self) -> list[int]:
        """Aux ids as HF `output_hidden_states` indices."""
        return list(self.index["aux_layer_ids"])

    @property
    def final_is_post_norm(self) -> bool:
        return self.index["final_state"] == FINAL_STATE

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def dtype(self) -> str:
        """Storage dtype: float32, bfloat16 or fp8_e4m3."""
        return str(self.index["dtype"])


class HiddenStates(IndexFacts):
    """Random access to the samples of a finished `02_hidden_states/` directory.

    Reads only the requested sample's rows of each tensor (safetensors slices), so a sample
    costs its own bytes, not its shard's. fp8 aux states come back dequantized (float32).
    A shard that is missing or whose header is cut is reported at open, naming the file.
    """

    def __init__(self, directory: str | Path,
                 repair: str = "python 02_extract_hidden_states.py CONFIG --repair") -> None:
        self.dir = Path(directory)
        self.repair = repair
        """The command that redoes a damaged shard (with the run's config and overrides)."""
        index_path = self.dir / INDEX
        try:
            self.index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            raise StageError(f"{index_path} is missing or unreadable: run `{repair}`") from None
        if self.index.get("format") != FORMAT:
            raise StageError(f"{index_path}: format {self.index.get('format')!r}, this reader "
                             f"knows {FORMAT!r}; redo stage 02 with --restart")
        if self.index.get("mode") == "stream":
            raise StageError(f"{index_path}: stage 02 ran with hidden_states.mode=stream and "
                             f"stored no states (eagle3.stream computes them while training)")
        self._handles: dict[int, Any] = {}
        self._where: list[tuple[int, int]] = []  # sample -> (shard, local index)
        self._offsets: list[list[int]] = []
        self._supervised_end: list[int] = []
        self.ids: list[str] = []
        for k, shard in enumerate(self.index["shards"]):
            self._open_shard(k, shard)

    def _open_shard(self, k: int, shard: dict[str, Any]) -> None:
        path = self.dir / shard["file"]
        if read_shard_header(path) is None:
            raise StageError(f"{path} is missing, truncated or not a shard: run "
                             f"`{self.repair}`")
        f = self._open(k)
        meta = json.loads(f.metadata()["eagle3"])
        offsets = f.get_tensor("offsets").tolist()
        mask = f.get_tensor("loss_mask")
        self.ids.extend(meta["ids"])
        self._offsets.append(offsets)
        self._where.extend((k, i) for i in range(shard["samples"]))
        for s, e in zip(offsets[:-1], offsets[1:]):
            on = mask[s:e].nonzero()
            self._supervised_end.append(int(on[-1]) + 1 if len(on) else 0)

    def _open(self, k: int) -> Any:
        from safetensors import safe_open

        if k not in self._handles:
            self._handles[k] = safe_open(str(self.dir / self.index["shards"][k]["file"]),
                                         framework="pt")
        return self._handles[k]

    def __len__(self) -> int:
        return len(self._where)

    def num_tokens(self, i: int) -> int:
        k, j = self._where[i]
        return self._offsets[k][j + 1] - self._offsets[k][j]

    def supervised_end(self, i: int) -> int:
        """One past sample i's last supervised (loss_mask = 1) token; 0 when it has none."""
        return self._supervised_end[i]

    def shard_of(self, i: int) -> str:
        return self.index["shards"][self._where[i][0]]["file"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self._where[i]
        s, e = self._offsets[k][j], self._offsets[k][j + 1]
        f = self._open(k)
        states = {name: f.get_slice(name)[s:e] for name in ("aux", "final")}
        if states["aux"].dtype == torch.float8_e4m3fn:
            states["aux_scale"] = f.get_slice("aux_scale")[s:e]
        return decode(f.get_slice("input_ids")[s:e], f.get_slice("loss_mask")[s:e], states)

    def get(self, group: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of one micro-batch."""
        return [self[i] for i in group]


# ---------------------------------------------------------------------------------------------
# Batches


def pack(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Greedy groups of samples (in the order of `indices`) of at most `budget` tokens each; a
    longer sample makes a group of its own (cut to the budget: stage 04 refuses to start when
    that would cut supervised tokens)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in indices:
        n = min(lengths[i], budget)
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


@dataclass
class Batch:
    """One packed row of documents, tensors shaped [1, T, ...]."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor
    doc_end: torch.Tensor
    """Exclusive end index (in the packed row) of each position's document."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device, dtype: torch.dtype) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(
            device, dtype=dtype if getattr(self, f.name).is_floating_point() else None)
            for f in dataclasses.fields(self)})


def collate(samples: list[dict[str, torch.Tensor]], max_tokens: int) -> Batch:
    """Samples packed into one row of at most `max_tokens`, with document ids, per-document
    positions and document ends (attention never crosses documents)."""
    ids, masks, aux, final, doc_ids, pos, end = [], [], [], [], [], [], []
    start = 0
    for d, s in enumerate(samples):
        T = min(len(s["input_ids"]), max_tokens)
        ids.append(s["input_ids"][:T].long())
        masks.append(s["loss_mask"][:T].bool())
        aux.append(s["aux"][:T])
        final.append(s["final"][:T])
        doc_ids.append(torch.full((T,), d, dtype=torch.long))
        pos.append(torch.arange(T, dtype=torch.long))
        end.append(torch.full((T,), start + T, dtype=torch.long))
        start += T
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    return Batch(cat(ids), cat(masks), cat(aux), cat(final), cat(doc_ids), cat(pos), cat(end))
