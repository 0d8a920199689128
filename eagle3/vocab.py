"""Stage 03: the draft vocabulary, from loss-masked token counts or from a base drafter.

    python 03_build_vocab_map.py configs/smollm2-135m-cpu.yaml [train.finetune_from=DIR]

Counts only supervised (assistant, loss_mask = 1) tokens, keeps the `draft_vocab_size` most
frequent (end-of-turn/EOS always in), pads with the lowest unseen ids when fewer distinct tokens
were seen, and writes `03_vocab/vocab.safetensors`:
  d2t [Vd] int64 OFFSETS: target_id = i + d2t[i]  (what vLLM and SGLang both expect)
  t2d [V]  bool mask of target ids in the draft vocabulary
plus the coverage of the supervised token mass.

When fine-tuning (`train.finetune_from`), the base drafter's map is copied verbatim
(`vocab.from_checkpoint`, on by default then): its lm_head rows belong to its tokens, and a
recomputed map would scramble them (SpecForge PR #534). Its coverage on our data is reported.
With `vocab.allow_remap` a new map is counted instead and stage 04 moves the base's lm_head rows
by target token (`remap_lm_head`). The manifest records which mode was used.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3 import base_drafter
from eagle3.config import Config
from eagle3.formats import vocab_map_problems
from eagle3.runs import Stage, StageError, atomic_path, file_records
from eagle3.verifier import load_tokenizer, stop_token_ids

log = logging.getLogger("eagle3")

VOCAB_FILE = "vocab.safetensors"


def count_tokens(input_ids: Iterable[np.ndarray], loss_masks: Iterable[np.ndarray],
                 vocab_size: int) -> np.ndarray:
    """Counts of each token id over positions with loss_mask == 1 (vectorized per sample)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids, loss_masks):
        counts += np.bincount(np.asarray(ids)[np.asarray(mask) == 1], minlength=vocab_size)
    return counts


def count_dataset(dataset_dir: Path, vocab_size: int, batch: int = 1024) -> np.ndarray:
    """`count_tokens` over a stage-01 dataset, read `batch` rows at a time (a production
    dataset's token lists need not fit in memory)."""
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir)).with_format("numpy")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for rows in ds.iter(batch_size=batch):
        counts += count_tokens(rows["input_ids"], rows["loss_mask"], vocab_size)
    return counts


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int,
                    always_include: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`draft_vocab_size` ids by count (ties to the lower id) -> (d2t offsets, t2d mask)."""
    V = len(counts)
    Vd = min(draft_vocab_size, V)
    forced = [i for i in dict.fromkeys(always_include) if 0 <= i < V][:Vd]
    # Sort by count descending, id ascending: stable argsort of -counts does exactly that, and
    # unseen ids (count 0) follow in ascending order, which is the padding rule.
    order = np.argsort(-counts, kind="stable")
    chosen = list(forced)
    taken = set(forced)
    for i in order:
        if len(chosen) == Vd:
            break
        if int(i) not in taken:
            chosen.append(int(i))
            taken.add(int(i))
    selected = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = selected - torch.arange(Vd, dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(len(d2t), dtype=torch.long) + d2t


def coverage(counts: np.ndarray, t2d: torch.Tensor) -> float:
    total = counts.sum()
    return float(counts[t2d.numpy()].sum() / total) if total else 0.0


def load_vocab(directory: Path, repair: str = "python 03_build_vocab_map.py CONFIG --repair"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    path = directory / VOCAB_FILE
    try:
        t = load_file(str(path))
        return t["d2t"], t["t2d"]
    except Exception as e:  # safetensors' own error for a truncated file, or a missing key
        raise StageError(f"{path} is unreadable ({type(e).__name__}): run `{repair}`") from None


def remap_lm_head(base_lm_head: torch.Tensor, base_d2t: torch.Tensor, new_d2t: torch.Tensor,
                  verifier_lm_head: torch.Tensor) -> torch.Tensor:
    """lm_head rows for the map `new_d2t`, moved from a base trained with `base_d2t`.

    Row i of the result scores target token i + new_d2t[i]: the base's row for that token when
    the base's map has it, else the verifier's lm_head row for it (the drafter's head starts as
    the verifier's, so a new token starts where a fresh drafter would).
    """
    if verifier_lm_head.shape[1] != base_lm_head.shape[1]:
        raise ValueError(f"verifier lm_head width {verifier_lm_head.shape[1]} != drafter width "
                         f"{base_lm_head.shape[1]}")
    new_targets = draft_to_target_ids(new_d2t)
    base_targets = draft_to_target_ids(base_d2t)
    row_of = torch.full((verifier_lm_head.shape[0],), -1, dtype=torch.long)
    row_of[base_targets] = torch.arange(len(base_targets))
    rows = row_of[new_targets]
    known = rows >= 0
    out = verifier_lm_head[new_targets].to(base_lm_head.dtype).clone()
    out[known] = base_lm_head[rows[known]]
    return out


def run_vocab(stage: Stage) -> None:
    """Stage 03 entry point (see the module docstring)."""
    cfg = stage.cfg
    stage.require(1)
    started = time.time()
    info = cfg.verifier_info
    counts = count_dataset(stage.upstream(1).dir / "dataset", info.vocab_size)
    eot = stop_token_ids(load_tokenizer(cfg), cfg)
    base = cfg.train.finetune_from
    if cfg.copies_base_vocab:
        d2t, t2d = _base_map(cfg)
        mode = "from_checkpoint"
    else:
        d2t, t2d = build_vocab_map(counts, cfg.vocab.size_for(info.vocab_size), eot)
        mode = "remap" if base else "counts"
    cov = coverage(counts, t2d)
    seen = int((counts > 0).sum())
    eot_missing = [i for i in eot if not bool(t2d[i])]
    log.info("draft vocab %d of %d ids (%s%s); %d distinct supervised tokens seen; coverage "
             "of the supervised token mass %.2f%%", len(d2t), info.vocab_size, mode,
             f" of {base}" if base else "", seen, 100 * cov)
    if eot_missing:
        log.warning("end-of-turn ids %s are not in the base drafter's vocabulary: it can "
                    "never draft them", eot_missing)
    stage.dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(stage.dir / VOCAB_FILE) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))
    stage.write_manifest(
        inputs={"01_data": stage.upstream_hash(1)},
        outputs={"vocab": VOCAB_FILE},
        counts={"draft_vocab_size": len(d2t), "vocab_size": info.vocab_size,
                "supervised_tokens": int(counts.sum()), "distinct_supervised_tokens": seen,
                "coverage": round(cov, 6), "end_of_turn_ids": eot,
                "end_of_turn_missing": eot_missing},
        files=file_records(stage.dir, [stage.dir / VOCAB_FILE]),
        started=started, vocab_source={"mode": mode, "base_drafter": base})


def _base_map(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The base drafter's (d2t, t2d), checked to be a valid map over this verifier."""
    base = cfg.train.finetune_from
    if not base:
        raise StageError("vocab.from_checkpoint=true needs train.finetune_from (the base "
                         "drafter whose map is copied)")
    d2t, t2d = base_drafter.load_vocab(base)
    vocab = cfg.verifier_info.vocab_size
    if t2d.numel() != vocab:
        raise StageError(f"base drafter {base} has a map over {t2d.numel()} target ids, the "
                         f"verifier has {vocab}: not a drafter of this verifier")
    bad = vocab_map_problems(d2t, t2d, d2t.numel(), vocab)
    if bad:
        raise StageError(f"base drafter {base}: {'; '.join(bad)}")
    return d2t, t2d
