"""Drafter weight files, one tensor at a time: the single owner of reading and writing them.

    tensors = open_weights(Path("drafter"))         # name -> LazyTensor (nothing read yet)
    fc = tensors["fc.weight"].load()                 # reads just this tensor
    write_safetensors(out / "model.safetensors", {"fc.weight": fc, **tensors})

A 1T-parameter verifier's drafter is ~2.6B parameters with its embedding (Kimi-K2.5: 5 GB in
bf16): loading it whole, converting and saving holds two copies at once. Here a `LazyTensor`
knows its shape and dtype from the file header and reads its bytes only on `load()` (or a row
range with `rows()`); `write_safetensors` writes the header from shapes alone and then each
tensor's bytes in turn, so a conversion holds one tensor at a time.

Reads model.safetensors, a sharded model.safetensors.index.json, and pytorch_model.bin (or its
index) through `torch.load(weights_only=True, mmap=True)`: tensors and containers only.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import safe_open

WEIGHT_CANDIDATES = ("model.safetensors.index.json", "model.safetensors",
                     "pytorch_model.bin.index.json", "pytorch_model.bin")

# safetensors dtype names (the format's spec) <-> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class WeightFilesError(ValueError):
    """Weight files that cannot be read; `problems` says what, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """One tensor of a weight file: shape and dtype known, bytes read on demand."""
    file: Path
    key: str
    shape: torch.Size
    dtype: torch.dtype
    _mapped: Optional[torch.Tensor] = None
    """A memory-mapped tensor (pickled checkpoints); safetensors are read through safe_open."""

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return _numel(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def load(self) -> torch.Tensor:
        if self._mapped is not None:
            return self._mapped.clone()
        with safe_open(str(self.file), "pt") as f:
            return f.get_tensor(self.key)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the first dimension, reading only those bytes."""
        if self._mapped is not None:
            return self._mapped[start:stop].clone()
        with safe_open(str(self.file), "pt") as f:
            return f.get_slice(self.key)[start:stop]


TensorLike = Union[torch.Tensor, LazyTensor]


def load(t: TensorLike) -> torch.Tensor:
    """The tensor itself (reading it if it is lazy)."""
    return t.load() if isinstance(t, LazyTensor) else t


def rows(t: TensorLike, start: int, stop: int) -> torch.Tensor:
    return t.rows(start, stop) if isinstance(t, LazyTensor) else t[start:stop]


def max_abs_difference(a: TensorLike, b: TensorLike, block_bytes: int = 256 << 20) -> float:
    """max |a - b| of two same-shaped tensors (b cast to a's dtype first, so equal weights
    stored in two dtypes compare equal), reading a block of rows of each at a time."""
    n = a.shape[0] if a.dim() else 1
    row_bytes = max(1, _numel(a.shape[1:]) * 4)
    step = max(1, block_bytes // row_bytes)
    worst = 0.0
    for start in range(0, n, step):
        x = rows(a, start, start + step) if a.dim() else load(a)
        y = (rows(b, start, start + step) if b.dim() else load(b)).to(x.dtype)
        if not torch.equal(x, y):
            d = float((x.float() - y.float()).abs().max())
            worst = float("inf") if d != d else max(worst, d)  # NaN: as different as can be
    return worst


def weight_file(path: Path) -> Optional[Path]:
    """The weights entry point of a drafter directory, or None."""
    return next((path / n for n in WEIGHT_CANDIDATES if (path / n).is_file()), None)


def open_weights(path: Path) -> dict[str, LazyTensor]:
    """Every tensor of a single-file or sharded checkpoint directory, by its key in the file,
    without reading any data."""
    found = weight_file(path)
    if found is None:
        raise WeightFilesError([f"no weights: expected one of {', '.join(WEIGHT_CANDIDATES)}"])
    if found.name.endswith(".index.json"):
        try:
            weight_map = json.loads(found.read_text())["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise WeightFilesError([f"{found.name} is not a valid index (no weight_map)"]
                                   ) from None
    else:
        files = [found]
    out: dict[str, LazyTensor] = {}
    for file in files:
        if not file.is_file():
            raise WeightFilesError([f"shard {file.name} named in the index is missing"])
        out.update(open_file(file))
    return out


def open_file(file: Path) -> dict[str, LazyTensor]:
    """Every tensor of one weight file (safetensors or pickled), unread."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                out = {}
                for k in f.keys():
                    s = f.get_slice(k)
                    out[k] = LazyTensor(file, k, torch.Size(s.get_shape()),
                                        _ST_DTYPES[s.get_dtype()])
                return out
        # A pickled state dict: weights_only refuses anything but tensors and containers;
        # mmap keeps the bytes on disk until a tensor is used.
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else "non-tensor objects"
        raise WeightFilesError([
            f"{file.name} holds more than tensors and was refused (weights_only loading: "
            f"{reason[:160]}); convert it to safetensors from a trusted source"]) from None
    except Exception as e:  # safetensors/torch raise their own types for a damaged file
        raise WeightFilesError([f"{file.name} is unreadable ({type(e).__name__}: "
                                f"{str(e)[:160]}): truncated or damaged"]) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise WeightFilesError([f"{file.name} is not a state dict of tensors"])
    return {k: LazyTensor(file, k, v.shape, v.dtype, v) for k, v in state.items()}


def write_safetensors(path: Path, tensors: Mapping[str, TensorLike],
                      dtypes: Optional[Mapping[str, torch.dtype]] = None,
                      metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file holding one tensor in memory at a time: the header from the
    shapes, then each tensor's bytes (read, cast to `dtypes[key]` when given, written, freed).
    Keys in sorted order, offsets contiguous, header padded to 8 bytes (the format's rules)."""
    dtypes = dtypes or {}
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    plan = []
    for key in sorted(tensors):
        t = tensors[key]
        dtype = dtypes.get(key, t.dtype)
        if dtype not in _ST_NAMES:
            raise ValueError(f"`{key}`: dtype {dtype} has no safetensors name")
        size = _numel(t.shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + size]}
        plan.append((key, dtype, size))
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, size in plan:
            t = load(tensors[key]).detach().to("cpu", dtype).contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != size:
                raise ValueError(f"`{key}` has {data.nbytes} bytes, its header says {size}")
            f.write(data.data)
            del t, data
    # Engines often run as another user (containers): readable by all, like save_file's
    # callers usually make it.
    os.chmod(path, 0o644)


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
