"""Stage 05: a drafter -> validated vLLM / SGLang / speculators directories.

    python 05_fix_keys.py configs/smollm2-135m-cpu.yaml [export.checkpoint=latest] [--restart]
    python 05_fix_keys.py --from DRAFTER_DIR --out DIR [--verifier PATH] [--formats vllm,sglang]

The stage reads the run's intact `04_train/<best|latest|step-N>` checkpoint (eagle3.checkpoint);
`--from` (eagle3.convert) reads any EAGLE-3 drafter directory (eagle3.base_drafter: speculators,
SGLang/AQ-MedAI `midlayer.*`, vLLM, ours). Neither is ever modified. Each format directory
(config.json, model.safetensors, README.md model card, eagle3_export.json: the record of where
it came from and which engine versions its aux ids are valid for) is built under a temporary
name, validated from disk (eagle3.formats.validate_export: keys, shapes, dtypes, finite weights,
d2t offsets, aux ids) and renamed. Tensors are read, converted and written one at a time
(eagle3.weights_io), so a Kimi-size drafter needs about one tensor of memory. A rerun keeps
every format directory that is intact, valid and made from the same drafter and settings.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from eagle3 import checkpoint as ckpt
from eagle3 import formats
from eagle3.model import DraftModelConfig
from eagle3.model_card import model_card, run_provenance
from eagle3.runs import (Stage, StageError, atomic_dir, atomic_write_json, clean_stale_tmp,
                         file_records, move_aside, verify_files)
from eagle3.weights_io import TensorLike

log = logging.getLogger("eagle3")

RECORD_FILE = "eagle3_export.json"
CARD_FILE = "README.md"


@dataclass
class Drafter:
    """What gets exported: weights in the speculators layout with d2t/t2d and no embedding
    (lazy: read one at a time while writing), their shape and the aux ids they were trained on
    (HF `output_hidden_states` indices)."""
    origin: Path
    draft: DraftModelConfig
    aux_layer_ids: list[int]
    weights: Mapping[str, TensorLike]


def export_context(stage: Stage) -> formats.ExportContext:
    cfg = stage.cfg
    return formats.ExportContext(
        verifier_path=str(cfg.verifier_path.resolve()),
        verifier_arch=cfg.verifier_info.architecture,
        speculative_tokens=cfg.export.speculative_tokens, sglang_rule=cfg.export.sglang_aux_ids)


def _kept(out: Path, fmt: str, source: dict[str, Any], d: Drafter,
          ctx: formats.ExportContext, mode: str) -> Optional[dict[str, Any]]:
    """The record of a finished format directory from this same source, intact and valid;
    else None (it is redone)."""
    try:
        record = json.loads((out / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("source") != source or verify_files(out, record.get("files", {}), mode):
        return None
    try:
        formats.validate_export(out, fmt, d.draft, d.aux_layer_ids, ctx)
    except formats.ExportValidationError as e:
        log.info("existing %s is invalid, redoing it: %s", out, e)
        return None
    return record


def export_format(out: Path, fmt: str, d: Drafter, ctx: formats.ExportContext,
                  source: dict[str, Any], dtype: Optional[str], provenance: dict[str, Any],
                  siblings: dict[str, Path]) -> dict[str, Any]:
    """Write, validate and describe one format directory atomically; return its record."""
    with atomic_dir(out) as tmp:
        formats.write_export(tmp, fmt, d.weights, d.draft, d.aux_layer_ids, ctx, dtype)
        try:
            summary = formats.validate_export(tmp, fmt, d.draft, d.aux_layer_ids, ctx)
        except formats.ExportValidationError as e:
            # A bug in the writer or an inconsistent drafter: never leave it looking done.
            raise StageError(f"{e}\nthe drafter {d.origin} does not export cleanly; fix it "
                             f"(or the config) and rerun") from None
        (tmp / CARD_FILE).write_text(model_card(fmt, summary, provenance, out, siblings))
        files = file_records(tmp, [tmp / formats.WEIGHTS_FILE, tmp / formats.CONFIG_FILE,
                                   tmp / CARD_FILE])
        record = {"source": source, **summary, "files": files}
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def export_all(root: Path, fmts: list[str], d: Drafter, ctx: formats.ExportContext,
               source: dict[str, Any], dtype: Optional[str], provenance: dict[str, Any],
               mode: str) -> dict[str, dict[str, Any]]:
    """Every format under `root/<fmt>/`: kept when intact, valid and from this same source,
    else (re)made. Shared by stage 05 and `--from`."""
    root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(root)
    siblings = {f: root / f for f in fmts}
    records: dict[str, dict[str, Any]] = {}
    for fmt in fmts:
        out = root / fmt
        if out.exists():
            kept = _kept(out, fmt, source, d, ctx, mode)
            if kept is not None:
                log.info("%s: already exported, intact and valid: kept", out)
                records[fmt] = kept
                continue
            log.info("%s: stale, damaged or incomplete: moved aside to %s", out,
                     move_aside(out, "stale"))
        try:
            records[fmt] = export_format(out, fmt, d, ctx, source, dtype, provenance, siblings)
        except formats.FormatError as e:
            raise StageError(f"cannot export {d.origin} as {fmt}: {e}") from None
        log.info("%s: %d keys, aux ids written %s (valid on %s), validated", out,
                 records[fmt]["num_keys"], records[fmt]["aux_layer_ids_written"],
                 ", ".join(records[fmt]["aux_ids_valid_for"]))
    return records


def _checked_checkpoint(stage: Stage) -> ckpt.Checkpoint:
    cfg = stage.cfg
    path = ckpt.resolve(stage.upstream(4).dir, cfg.export.checkpoint, cfg.run.verify,
                        stage.upstream(4).command("--repair"))
    c = ckpt.load(path, lazy=True)
    info = cfg.verifier_info
    if list(info.aux_layer_ids) != c.aux_layer_ids:
        raise StageError(f"{path} was trained on aux ids {c.aux_layer_ids} but the config "
                         f"resolves {list(info.aux_layer_ids)}: fix verifier.aux_layer_ids")
    if c.draft.vocab_size != info.vocab_size or c.draft.target_hidden_size != info.hidden_size:
        raise StageError(f"{path} does not fit verifier {cfg.verifier.path} (vocab "
                         f"{c.draft.vocab_size} vs {info.vocab_size}, hidden "
                         f"{c.draft.target_hidden_size} vs {info.hidden_size}): wrong run or "
                         f"verifier")
    return c


def run_export(stage: Stage) -> None:
    """Stage 05 entry point (see the module docstring)."""
    started = time.time()
    cfg = stage.cfg
    stage.require(4)
    c = _checked_checkpoint(stage)
    d = Drafter(c.path, c.draft, c.aux_layer_ids, c.weights)
    ctx = export_context(stage)
    # Everything a kept format directory must have been made from (else it is redone).
    source = {"checkpoint": str(c.path), "upstream_sha256": stage.upstream_hash(4),
              "dtype": cfg.export.dtype, "sglang_aux_ids": cfg.export.sglang_aux_ids,
              "speculative_tokens": cfg.export.speculative_tokens,
              "verifier": ctx.verifier_path}
    provenance = run_provenance(cfg, c.path, c.step)
    records = export_all(stage.dir, list(cfg.export.formats), d, ctx, source, cfg.export.dtype,
                         provenance, cfg.run.verify)
    report = {"checkpoint": str(c.path), "draft_config": c.draft.to_dict(),
              "aux_layer_ids_internal": c.aux_layer_ids, "provenance": provenance,
              "formats": records}
    atomic_write_json(stage.dir / "report.json", report)
    stage.write_manifest(
        inputs={"checkpoint": str(c.path), "upstream_sha256": source["upstream_sha256"]},
        outputs={fmt: str(stage.dir / fmt) for fmt in records} | {
            "report": str(stage.dir / "report.json")},
        counts={"formats": len(records),
                "keys": {fmt: r["num_keys"] for fmt, r in records.items()},
                "parameters": next(iter(records.values()))["num_parameters"] if records else 0},
        files=file_records(stage.dir, [stage.dir / fmt for fmt in records]),
        started=started,
        aux_layer_ids={fmt: r["aux_layer_ids_written"] for fmt, r in records.items()},
    )
