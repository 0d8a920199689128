"""Training checkpoints (`04_train/step-N/`) and selective reads of the verifier's weights.

A checkpoint directory is built under a temporary name and renamed, so every `step-N/` that
exists is complete; `latest` and `best` are small pointer files replaced atomically after the
directory exists. Each holds:
  model.safetensors   the drafter (speculators layout `layers.N.*`, d2t, t2d; no embedding)
  config.json         speculators-format config (vLLM can serve the directory as is)
  draft_config.json   our DraftModelConfig + aux ids (shape-defining facts for resume)
  trainer_state.pt    optimizer, scheduler, TrainState (step, data position, best metric), RNG
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.runs import atomic_dir, atomic_write_text

STEP_RE = re.compile(r"^step-(\d+)$")
REQUIRED = ("model.safetensors", "config.json", "draft_config.json", "trainer_state.pt")


# ---------------------------------------------------------------------------------------------
# Verifier weights, read tensor by tensor (a 1T-parameter checkpoint is never loaded whole)


def _weight_files(verifier: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = verifier / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: verifier / v for k, v in weight_map.items()}
    single = verifier / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {verifier}")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


# Name candidates: plain causal LMs, and multimodal wrappers whose text model sits under
# `language_model` (Kimi-K2.5).
_CANDIDATES = {
    "embed": ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
              "model.language_model.embed_tokens.weight"],
    "lm_head": ["lm_head.weight", "language_model.lm_head.weight"],
    "norm": ["model.norm.weight", "language_model.model.norm.weight",
             "model.language_model.norm.weight"],
}


def read_verifier_tensor(verifier: Path, what: str) -> torch.Tensor:
    """The verifier's `embed`, `lm_head` (tied heads fall back to the embedding) or final
    `norm` weight, reading only that tensor from disk."""
    files = _weight_files(verifier)
    names = _CANDIDATES[what] + (_CANDIDATES["embed"] if what == "lm_head" else [])
    for name in names:
        if name in files:
            with safe_open(str(files[name]), "pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"verifier {verifier} has none of {names}")


# ---------------------------------------------------------------------------------------------
# Step checkpoints


def step_dirs(train_dir: Path) -> list[tuple[int, Path]]:
    out = []
    if train_dir.is_dir():
        for p in train_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and all((p / f).is_file() for f in REQUIRED):
                out.append((int(m.group(1)), p))
    return sorted(out)


def read_pointer(train_dir: Path, name: str) -> Path | None:
    ptr = train_dir / name
    if not ptr.is_file():
        return None
    target = train_dir / ptr.read_text().strip()
    return target if target.is_dir() else None


def find_latest(train_dir: Path) -> Path | None:
    """The newest complete step directory (the pointer may lag a crash by one checkpoint)."""
    dirs = step_dirs(train_dir)
    return dirs[-1][1] if dirs else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(train_dir: Path, step: int, weights: dict[str, torch.Tensor],
                    speculators_config: dict[str, Any], draft_config: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write `step-N/` atomically and point `latest` at it."""
    path = train_dir / f"step-{step}"
    if path.exists():  # a previous run got this far; the content is identical by determinism
        shutil.rmtree(path)
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(speculators_config, indent=2) + "\n")
        (tmp / "draft_config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
        torch.save(trainer_state, tmp / "trainer_state.pt")
    atomic_write_text(train_dir / "latest", path.name + "\n")
    return path


def set_best(train_dir: Path, path: Path) -> None:
    atomic_write_text(train_dir / "best", path.name + "\n")


def prune(train_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories, never the one `best` points to."""
    best = read_pointer(train_dir, "best")
    dirs = step_dirs(train_dir)
    for _, p in dirs[:-keep]:
        if best is None or p.resolve() != best.resolve():
            shutil.rmtree(p)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, draft_config, trainer_state) of a step directory."""
    weights = load_file(str(path / "model.safetensors"))
    draft_config = json.loads((path / "draft_config.json").read_text())
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    return weights, draft_config, state
