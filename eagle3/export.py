"""Stage 05: training checkpoint -> validated vLLM / SGLang / speculators directories.

    python 05_fix_keys.py configs/smollm2-135m-cpu.yaml [export.checkpoint=latest] [--restart]

Reads the intact `04_train/<best|latest|step-N>` checkpoint (eagle3.checkpoint), never modifies
it, and writes `05_export/<fmt>/` (config.json + model.safetensors + eagle3_export.json, the
record of where it came from and which engine versions its aux ids are valid for) for each of
`export.formats`, each built under a temporary name, validated from disk
(eagle3.formats.validate_export: keys, shapes, dtypes, finite weights, d2t offsets, aux ids) and
renamed. Then `report.json` and the manifest. A rerun keeps every format directory that is
intact, valid and made from the same checkpoint and settings, and redoes the rest.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from eagle3 import checkpoint as ckpt
from eagle3 import formats
from eagle3.runs import (Stage, StageError, atomic_dir, atomic_write_json, clean_stale_tmp,
                         file_records, move_aside, verify_files)

log = logging.getLogger("eagle3")

RECORD_FILE = "eagle3_export.json"


def export_context(stage: Stage) -> formats.ExportContext:
    cfg = stage.cfg
    return formats.ExportContext(
        verifier_path=str(cfg.verifier_path.resolve()),
        verifier_arch=cfg.verifier_info.architecture,
        speculative_tokens=cfg.export.speculative_tokens, sglang_rule=cfg.export.sglang_aux_ids)


def _kept(out: Path, fmt: str, source: dict[str, Any], c: ckpt.Checkpoint,
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
        formats.validate_export(out, fmt, c.draft, c.aux_layer_ids, ctx)
    except formats.ExportValidationError as e:
        log.info("existing %s is invalid, redoing it: %s", out, e)
        return None
    return record


def export_format(out: Path, fmt: str, c: ckpt.Checkpoint, ctx: formats.ExportContext,
                  source: dict[str, Any], dtype: Optional[str]) -> dict[str, Any]:
    """Write and validate one format directory atomically; return its record."""
    with atomic_dir(out) as tmp:
        formats.write_export(tmp, fmt, c.weights, c.draft, c.aux_layer_ids, ctx, dtype)
        try:
            summary = formats.validate_export(tmp, fmt, c.draft, c.aux_layer_ids, ctx)
        except formats.ExportValidationError as e:
            # A bug in the writer or an inconsistent checkpoint: never leave it looking done.
            raise StageError(f"{e}\nthe checkpoint {c.path} does not export cleanly; fix it "
                             f"(or the config) and rerun") from None
        files = file_records(tmp, [tmp / formats.WEIGHTS_FILE, tmp / formats.CONFIG_FILE])
        record = {"source": source, **summary, "files": files}
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _checked_checkpoint(stage: Stage) -> ckpt.Checkpoint:
    cfg = stage.cfg
    path = ckpt.resolve(stage.upstream(4).dir, cfg.export.checkpoint, cfg.run.verify)
    c = ckpt.load(path)
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
    ctx = export_context(stage)
    # Everything a kept format directory must have been made from (else it is redone).
    source = {"checkpoint": str(c.path), "upstream_manifest_sha256": stage.upstream_hash(4),
              "dtype": cfg.export.dtype, "sglang_aux_ids": cfg.export.sglang_aux_ids,
              "speculative_tokens": cfg.export.speculative_tokens,
              "verifier": ctx.verifier_path}
    stage.dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(stage.dir)
    records: dict[str, dict[str, Any]] = {}
    for fmt in cfg.export.formats:
        out = stage.dir / fmt
        if out.exists():
            kept = _kept(out, fmt, source, c, ctx, cfg.run.verify)
            if kept is not None:
                log.info("%s: already exported, intact and valid: kept", out)
                records[fmt] = kept
                continue
            log.info("%s: stale, damaged or incomplete: moved aside to %s", out,
                     move_aside(out, "stale"))
        try:
            records[fmt] = export_format(out, fmt, c, ctx, source, cfg.export.dtype)
        except formats.FormatError as e:
            raise StageError(f"cannot export {c.path} as {fmt}: {e}") from None
        log.info("%s: %d keys, aux ids written %s (valid on %s), validated", out,
                 records[fmt]["num_keys"], records[fmt]["aux_layer_ids_written"],
                 ", ".join(records[fmt]["aux_ids_valid_for"]))
    report = {"checkpoint": str(c.path), "draft_config": c.draft.to_dict(),
              "aux_layer_ids_internal": c.aux_layer_ids, "formats": records}
    atomic_write_json(stage.dir / "report.json", report)
    stage.write_manifest(
        inputs={"checkpoint": str(c.path), "upstream_manifest_sha256": source[
            "upstream_manifest_sha256"]},
        outputs={fmt: str(stage.dir / fmt) for fmt in records} | {
            "report": str(stage.dir / "report.json")},
        counts={"formats": len(records),
                "keys": {fmt: r["num_keys"] for fmt, r in records.items()},
                "parameters": next(iter(records.values()))["num_parameters"] if records else 0},
        files=file_records(stage.dir, [stage.dir / fmt for fmt in records]),
        started=started,
        aux_layer_ids={fmt: r["aux_layer_ids_written"] for fmt, r in records.items()},
    )
