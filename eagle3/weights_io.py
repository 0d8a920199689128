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
index) through `torch.load(weights_only=True, mmap=True)`: tensors and containers only. Every
reader of a directory of weights (base drafters, `05_fix_keys.py --from`, the verifier) gets
its key -> file map from `weight_map`, which takes each key from the file the index names and
refuses a directory whose files and index disagree.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import safe_open

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


INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weight_map(path: Path) -> dict[str, Path]:
    """Key -> the one file that holds it, for a directory of weights, checked against what
    every file holds (headers only).

    With an index (model.safetensors.index.json; pytorch_model.bin.index.json where there is
    no *.safetensors file) its `weight_map` decides. vLLM and SGLang load every key of every
    file the index names, the last file read winning, so a stale copy of a key in another shard
    is what they serve while transformers reads the mapped one: refused, in one line naming the
    file and the key, are a key in two files, a key a shard holds but the index does not map, a
    key mapped to a file that does not hold it, and an index naming a missing file. Without an
    index every *.safetensors file is read, as the engines do (else pytorch_model.bin), and a
    key in two of them is refused the same way. Cached per state of the directory: a 64-shard
    verifier's headers are read once per process, not once per tensor looked up.
    """
    found = [_stat(f) for f in sorted(path.iterdir()) if f.is_file()] if path.is_dir() else []
    return dict(_checked_map(path, tuple(found)))


def _stat(file: Path) -> tuple[str, int, int, int]:
    """What changes when a file is rewritten, in place (size, mtime) or replaced (inode)."""
    st = file.stat()
    return file.name, st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=8)
def _checked_map(path: Path, state: tuple) -> dict[str, Path]:
    """`weight_map` for one state of the directory (`state`, its files' `_stat`s, only keys
    the cache)."""
    index = _index_of(path)
    mapped = _read_index(index) if index else None
    held = {file: _keys_of(file) for file in _files(path, mapped)}
    problem = _duplicate_problem(held, mapped)
    if mapped is not None:
        problem = problem or _unmapped_problem(held, mapped, index) or _unheld_problem(
            held, mapped, index)
    if problem:
        raise WeightFilesError([problem])
    return mapped if mapped is not None else {k: f for f, keys in held.items() for k in keys}


def listed_files(path: Path) -> list[Path]:
    """The files a reader of the directory reads: those its index names (each must exist),
    else `_unindexed_files`. Nothing but the index is read."""
    index = _index_of(path)
    return _files(path, _read_index(index) if index else None)


def _index_of(path: Path) -> Optional[Path]:
    """Safetensors first, as the engines read them: their index, else (no *.safetensors file)
    the pickled checkpoint's index."""
    if (path / INDEX_NAMES[0]).is_file():
        return path / INDEX_NAMES[0]
    if (path / INDEX_NAMES[1]).is_file() and not any(path.glob("*.safetensors")):
        return path / INDEX_NAMES[1]
    return None


def _files(path: Path, mapped: Optional[dict[str, Path]]) -> list[Path]:
    return sorted(set(mapped.values())) if mapped is not None else _unindexed_files(path)


def _read_index(index: Path) -> dict[str, Path]:
    """The index's key -> file map; every file it names must exist."""
    try:
        names = json.loads(index.read_text())["weight_map"]
        mapped = {str(k): index.parent / str(v) for k, v in names.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise WeightFilesError([f"{index.name} is not a valid index (no weight_map)"]) from None
    absent = {}
    for key, file in sorted(mapped.items()):
        if not file.is_file():
            absent.setdefault(file, []).append(key)
    if absent:
        file, keys = next(iter(absent.items()))
        raise WeightFilesError([f"{index.name} maps `{keys[0]}`{_more(keys)} to {file.name}, "
                                f"which is missing: restore the shard or the whole directory"])
    return mapped


def _unindexed_files(path: Path) -> list[Path]:
    """What a directory without an index holds: every *.safetensors file (engines load them
    all), else pytorch_model.bin."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files and (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    if not files:
        raise WeightFilesError([f"no weights: expected model.safetensors, *.safetensors "
                                f"shards, pytorch_model.bin, or one of {', '.join(INDEX_NAMES)}"])
    return files


def _keys_of(file: Path) -> set[str]:
    """The keys one file holds."""
    if file.suffix == ".safetensors":  # the header alone, without a LazyTensor per key
        try:
            with safe_open(str(file), "pt") as f:
                return set(f.keys())
        except Exception as e:  # safetensors raises its own types for a damaged file
            raise WeightFilesError([f"{file.name} is unreadable ({type(e).__name__}: "
                                    f"{str(e)[:160]}): truncated or damaged"]) from None
    return set(open_file(file))


def _duplicate_problem(held: dict[Path, set[str]], mapped: Optional[dict[str, Path]]
                       ) -> Optional[str]:
    owners: dict[str, list[Path]] = {}
    for file, keys in held.items():
        for key in keys:
            owners.setdefault(key, []).append(file)
    twice = sorted(k for k, files in owners.items() if len(files) > 1)
    if not twice:
        return None
    key = twice[0]
    first, second = owners[key][:2]
    where = (f"; the index maps it to {mapped[key].name}" if mapped and key in mapped else "")
    return (f"`{key}`{_more(twice)} is in two files, {first.name} and {second.name}{where}: "
            f"engines load both and keep whichever they read last; delete the stale copy")


def _unmapped_problem(held: dict[Path, set[str]], mapped: dict[str, Path], index: Path
                      ) -> Optional[str]:
    for file, keys in held.items():
        extra = sorted(k for k in keys if k not in mapped)
        if extra:
            return (f"{file.name} holds `{extra[0]}`{_more(extra)}, which {index.name} does not "
                    f"map: the index is stale; fix it or remove the tensor")
    return None


def _unheld_problem(held: dict[Path, set[str]], mapped: dict[str, Path], index: Path
                    ) -> Optional[str]:
    lost = sorted(k for k, file in mapped.items() if k not in held[file])
    if not lost:
        return None
    return (f"{index.name} maps `{lost[0]}`{_more(lost)} to {mapped[lost[0]].name}, which does "
            f"not hold it: the shard is incomplete or the index stale; restore the files")


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def open_weights(path: Path) -> dict[str, LazyTensor]:
    """Every tensor of a directory of weights, each from the file `weight_map` assigns it,
    without reading any data."""
    owner = weight_map(path)
    opened = {file: open_file(file) for file in sorted(set(owner.values()))}
    return {key: opened[file][key] for key, file in owner.items()}


def all_finite(t: TensorLike, block_bytes: int = 256 << 20) -> bool:
    """Whether a float tensor holds no NaN or infinity, reading a block of rows at a time (a
    Kimi-size embedding is 2 GB)."""
    if not t.is_floating_point():
        return True
    n = t.shape[0] if t.dim() else 1
    row_bytes = max(1, _numel(t.shape[1:]) * t.dtype.itemsize)
    step = max(1, block_bytes // row_bytes)
    for start in range(0, n, step):
        x = rows(t, start, start + step) if t.dim() else load(t)
        if x.element_size() == 1:  # float8: isfinite has no kernel for it on every build
            x = x.float()
        if not bool(torch.isfinite(x).all()):
            return False
    return True


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
