"""Training checkpoints: the one owner of the `04_train/step-N/` contract.

A step directory is built under a temporary name and renamed, so every `step-N/` that exists
was written whole; `checkpoint.json`, written last inside it, records the drafter's shape, its
aux ids and the size and sha256 of every other file. A checkpoint is *intact* when its files
still match that record: resume and export only ever use intact checkpoints, and a damaged
newest one (a truncated `trainer_state.pt`, say) makes resume fall back to the previous one.
`latest` and `best` are small pointer files replaced atomically after the directory exists.

    step-N/model.safetensors   the drafter (speculators layout `layers.N.*`, d2t, t2d; no
                               embedding)
    step-N/config.json         speculators-format config (vLLM can serve the directory as is)
    step-N/trainer_state.pt    optimizer, scheduler, TrainState, every rank's RNG state
    step-N/checkpoint.json     {step, draft, aux_layer_ids, files}

    path = save(train_dir, step, weights, draft, aux_ids, speculators_cfg, trainer_state)
    ckpt = load(resolve(train_dir, "best"))      # Checkpoint(path, step, draft, aux, weights)
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.model import DraftModelConfig
from eagle3.runs import (StageError, atomic_dir, atomic_write_text, file_record, move_aside,
                         verify_files)
from eagle3.weights_io import TensorLike, open_file

log = logging.getLogger("eagle3")

STEP_RE = re.compile(r"^step-(\d+)$")
RECORD = "checkpoint.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TRAINER_STATE = "trainer_state.pt"


@dataclass
class Checkpoint:
    path: Path
    step: int
    draft: DraftModelConfig
    aux_layer_ids: list[int]
    """HF `output_hidden_states` indices the drafter was trained on."""
    recipe: Optional[dict[str, Any]]
    """The stage-04 settings it was trained with (None: written before they were recorded)."""
    weights: dict[str, TensorLike]
    trainer_state: Optional[dict[str, Any]] = None
    """Only when loaded for resuming."""


def save(train_dir: Path, step: int, weights: dict[str, torch.Tensor], draft: DraftModelConfig,
         aux_layer_ids: list[int], speculators_config: dict[str, Any],
         trainer_state: dict[str, Any], recipe: dict[str, Any]) -> Path:
    """Write `step-N/` atomically (record last) and point `latest` at it. `recipe`: the
    stage-04 settings the weights depend on (`runs.depends_on(cfg, 4, own_only=True)`), which a
    resume must match."""
    path = train_dir / f"step-{step}"
    if path.exists():  # a previous run got this far; the content is identical by determinism
        shutil.rmtree(path)
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                  str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(speculators_config, indent=2) + "\n")
        save_trainer_state(trainer_state, tmp / TRAINER_STATE)
        record = {"step": step, "draft": draft.to_dict(),
                  "aux_layer_ids": [int(i) for i in aux_layer_ids], "recipe": recipe,
                  "files": {name: file_record(tmp / name)
                            for name in (WEIGHTS, CONFIG, TRAINER_STATE)}}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    atomic_write_text(train_dir / "latest", path.name + "\n")
    return path


def save_trainer_state(state: dict[str, Any], path: Path) -> None:
    """torch.save through a Python file: given a path, torch's own writer reports a full disk
    as "unexpected pos 704 vs 598"; through a file object the OS error (ENOSPC) comes back, and
    the CLI names the full disk."""
    with open(path, "wb") as f:
        torch.save(state, f)


def _record(path: Path) -> Optional[dict[str, Any]]:
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


def damage(path: Path, mode: str = "sha256") -> list[str]:
    """What no longer matches the checkpoint's record ([] = intact); `mode` is `run.verify`."""
    record = _record(path)
    if record is None:
        return [f"{RECORD} missing or unreadable"]
    return verify_files(path, record["files"], mode)


def step_dirs(train_dir: Path) -> list[tuple[int, Path]]:
    """Every `step-N/` directory, oldest first (intact or not)."""
    out = []
    if train_dir.is_dir():
        for p in train_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


def check_kept(train_dir: Path, mode: str, scores: dict[int, float]) -> Optional[Path]:
    """Check every kept checkpoint and what the pointers name, before a resume (and so before
    `--repair` vouches for anything): damaged checkpoints are moved aside (never deleted) with a
    warning, so training resumes from the newest intact one and rewrites the newer ones;
    `latest` moves to the newest intact checkpoint, and a `best` that names a damaged or missing
    one moves to the intact checkpoint with the highest recorded validation score (`scores`:
    step -> val est_accept_len). Returns the newest intact checkpoint, or None."""
    intact = []
    for step, path in step_dirs(train_dir):
        problems = damage(path, mode)
        if problems:
            moved = move_aside(path, "damaged")
            log.warning("checkpoint %s is damaged (%s); moved to %s", path.name, problems[0],
                        moved.name)
        else:
            intact.append((step, path))
    newest = intact[-1][1] if intact else None
    if pointer_target(train_dir, "latest") != (newest.name if newest else None):
        _repoint(train_dir, "latest", newest)
    named = pointer_target(train_dir, "best")
    if named is not None and named not in {p.name for _, p in intact}:
        best = max(intact, key=lambda sp: (scores.get(sp[0], float("-inf")), sp[0]),
                   default=(0, None))[1]
        log.warning("`best` named %s, which is damaged or missing; it now names %s", named,
                    best.name if best else "nothing (no intact checkpoint)")
        _repoint(train_dir, "best", best)
    return newest


def pointer_target(train_dir: Path, name: str) -> Optional[str]:
    """The step directory name a pointer file holds (whether or not it exists), or None."""
    ptr = train_dir / name
    try:
        return ptr.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _repoint(train_dir: Path, name: str, target: Optional[Path]) -> None:
    if target is None:
        (train_dir / name).unlink(missing_ok=True)
    else:
        atomic_write_text(train_dir / name, target.name + "\n")


def read_pointer(train_dir: Path, name: str) -> Optional[Path]:
    """The step directory a pointer names, when it exists."""
    target = pointer_target(train_dir, name)
    return train_dir / target if target and STEP_RE.match(target) and \
        (train_dir / target).is_dir() else None


def resolve(train_dir: Path, which: str, mode: str = "sha256",
            repair: str = "python 04_train.py CONFIG --repair") -> Path:
    """`best`, `latest` or `step-N` of a training run, checked intact; `repair` is the command
    a damaged one names."""
    if STEP_RE.match(which):
        path = train_dir / which
        if not path.is_dir():
            have = ", ".join(p.name for _, p in step_dirs(train_dir)) or "none"
            raise StageError(f"no checkpoint {which} in {train_dir} (kept: {have})")
    else:
        path = read_pointer(train_dir, which)
        if path is None:
            raise StageError(f"no `{which}` checkpoint in {train_dir}: finish `python "
                             f"04_train.py` or set export.checkpoint")
    problems = damage(path, mode)
    if problems:
        raise StageError(f"checkpoint {path} is damaged ({problems[0]}): rerun `{repair}`, or "
                         f"export another checkpoint")
    return path


def load(path: Path, with_trainer_state: bool = False, lazy: bool = False) -> Checkpoint:
    """A checkpoint's weights and shape facts (and its trainer state, to resume); `lazy`
    weights are read one at a time when used (eagle3.weights_io: exporting)."""
    record = _record(path)
    if record is None:
        raise StageError(f"{path} has no readable {RECORD}: not a checkpoint of this trainer")
    state = None
    if with_trainer_state:
        state = _load_trainer_state(path / TRAINER_STATE)
    return Checkpoint(path=path, step=int(record["step"]),
                      draft=DraftModelConfig.from_dict(record["draft"]),
                      aux_layer_ids=[int(i) for i in record["aux_layer_ids"]],
                      recipe=record.get("recipe"),
                      weights=(open_file(path / WEIGHTS) if lazy else
                               load_file(str(path / WEIGHTS))), trainer_state=state)


def _load_trainer_state(file: Path) -> dict[str, Any]:
    """Tensors and plain data only: unpickling anything else could run code from a crafted
    file, so it is refused."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0][:200]
        raise StageError(f"{file} holds more than tensors and plain data ({reason}): it was not "
                         f"written by this trainer; move its step directory aside, or rerun "
                         f"04_train.py with --restart") from None


def set_best(train_dir: Path, path: Path) -> None:
    atomic_write_text(train_dir / "best", path.name + "\n")


def prune(train_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories, never the one `best` points to."""
    best = read_pointer(train_dir, "best")
    for _, p in step_dirs(train_dir)[:-keep]:
        if best is None or p.resolve() != best.resolve():
            shutil.rmtree(p)


def rng_state() -> dict[str, Any]:
    """Every generator's state as plain data (a trainer state loads weights-only; tensors
    gathered from other ranks pickle their storages in a form the weights-only reader refuses,
    so none are kept here)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
