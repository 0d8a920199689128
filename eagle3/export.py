"""Stage 05: training checkpoint -> validated vLLM / SGLang / speculators directories.

    python 05_fix_keys.py configs/smollm2-135m-cpu.yaml [export.checkpoint=latest] [--restart]

Reads `<run>/04_train/<best|latest>` (a pointer file naming a `step-N/` directory), never
modifies it, and writes `<run>/05_export/<fmt>/` (config.json + model.safetensors +
eagle3_export.json, the record of where it came from) for each of `export.formats`, each built
under a temporary name, validated from disk (eagle3.formats.validate_export) and renamed.
Then `report.json` and the manifest. A rerun keeps every format directory that is complete,
valid and made from the same checkpoint, and redoes the rest.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from eagle3 import formats
from eagle3.model import DraftModelConfig
from eagle3.runs import Stage, StageError, atomic_dir, atomic_write_json, clean_stale_tmp

log = logging.getLogger("eagle3")

RECORD_FILE = "eagle3_export.json"
CHECKPOINT_FILES = ("model.safetensors", "draft_config.json")


def resolve_checkpoint(train_dir: Path, which: str) -> Path:
    """`<train_dir>/<which>` names a step directory; return it, checked to be complete."""
    pointer = train_dir / which
    if not pointer.is_file():
        raise StageError(f"no `{which}` pointer in {train_dir}: finish `python 04_train.py` or "
                         f"set export.checkpoint to best/latest")
    name = pointer.read_text().strip()
    ckpt = train_dir / name
    missing = [f for f in CHECKPOINT_FILES if not (ckpt / f).is_file()]
    if not name or not ckpt.is_dir() or missing:
        raise StageError(f"{pointer} names `{name}` but {ckpt} is not a complete checkpoint "
                         f"(missing {missing or 'directory'}): rerun `python 04_train.py`")
    return ckpt


def load_checkpoint(ckpt: Path) -> tuple[DraftModelConfig, list[int], dict[str, Any]]:
    """(draft config, aux ids in the internal convention, tensors) of a step-N directory."""
    raw = json.loads((ckpt / "draft_config.json").read_text())
    if "aux_layer_ids" not in raw:
        raise StageError(f"{ckpt}/draft_config.json has no `aux_layer_ids`: the checkpoint "
                         f"cannot say which verifier layers it was trained on")
    draft = DraftModelConfig.from_dict(raw)
    return draft, [int(i) for i in raw["aux_layer_ids"]], load_file(str(ckpt / "model.safetensors"))


def _existing_ok(out: Path, fmt: str, source: dict[str, Any], draft: DraftModelConfig,
                 aux: list[int], convention: formats.SglangConvention) -> dict[str, Any] | None:
    """The record of a finished format directory from this same source, else None."""
    record_path = out / RECORD_FILE
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    if record.get("source") != source:
        return None
    try:
        formats.validate_export(out, fmt, draft, aux, convention)
    except formats.ExportValidationError as e:
        log.info("existing %s is invalid, redoing it: %s", out, e)
        return None
    return record


def _move_aside(path: Path) -> Path:
    dest = path.with_name(f"{path.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(path, dest)
    return dest


def export_format(out: Path, fmt: str, tensors: dict[str, Any], draft: DraftModelConfig,
                  aux: list[int], verifier_path: str, verifier_arch: str,
                  convention: formats.SglangConvention, speculative_tokens: int,
                  source: dict[str, Any], dtype: str | None = None) -> dict[str, Any]:
    """Write and validate one format directory atomically; return its record."""
    with atomic_dir(out) as tmp:
        formats.write_export(tmp, fmt, tensors, draft, aux, verifier_path, verifier_arch,
                             convention, speculative_tokens, dtype)
        try:
            summary = formats.validate_export(tmp, fmt, draft, aux, convention)
        except formats.ExportValidationError as e:
            # A bug in the writer or an inconsistent checkpoint: never leave it looking done.
            raise StageError(f"{e}\nthe checkpoint {source['checkpoint']} does not export "
                             f"cleanly; fix it (or the config) and rerun") from None
        record = {"source": source, **summary}
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_export(stage: Stage) -> None:
    """Stage 05 entry point (see the module docstring)."""
    started = time.time()
    cfg = stage.cfg
    stage.require(4)
    train_dir = stage.upstream(4).dir
    ckpt = resolve_checkpoint(train_dir, cfg.export.checkpoint)
    draft, aux, tensors = load_checkpoint(ckpt)
    info = cfg.verifier_info
    if list(info.aux_layer_ids) != aux:
        raise StageError(f"{ckpt} was trained on aux ids {aux} but the config resolves "
                         f"{list(info.aux_layer_ids)}: fix verifier.aux_layer_ids")
    if draft.vocab_size != info.vocab_size or draft.target_hidden_size != info.hidden_size:
        raise StageError(f"{ckpt} does not fit verifier {cfg.verifier.path} (vocab "
                         f"{draft.vocab_size} vs {info.vocab_size}, hidden "
                         f"{draft.target_hidden_size} vs {info.hidden_size}): wrong run or "
                         f"verifier")
    convention = cfg.export.sglang_aux_offset
    # Everything a kept format directory must have been made from (else it is redone).
    source = {"checkpoint": str(ckpt), "upstream_manifest_sha256": stage.upstream_hash(4),
              "dtype": cfg.export.dtype, "sglang_aux_offset": convention,
              "verifier": str(cfg.verifier_path)}
    # speculators' speculative_tokens is only the default depth of `vllm serve DIR`.
    depth = max(cfg.bench.num_speculative_tokens)

    stage.dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(stage.dir)
    records: dict[str, dict[str, Any]] = {}
    for fmt in cfg.export.formats:
        out = stage.dir / fmt
        if out.exists():
            record = _existing_ok(out, fmt, source, draft, aux, convention)
            if record is not None:
                log.info("%s: already exported and valid, kept", out)
                records[fmt] = record
                continue
            log.info("%s: stale or incomplete, moved aside to %s", out, _move_aside(out))
        try:
            records[fmt] = export_format(out, fmt, tensors, draft, aux, str(cfg.verifier_path),
                                         info.architecture, convention, depth, source,
                                         cfg.export.dtype)
        except formats.FormatError as e:
            raise StageError(f"cannot export {ckpt} as {fmt}: {e}") from None
        log.info("%s: %d keys, aux ids written %s (%s), validated", out,
                 records[fmt]["num_keys"], records[fmt]["aux_layer_ids_written"],
                 records[fmt]["aux_convention"])

    report = {"checkpoint": str(ckpt), "draft_config": draft.to_dict(),
              "aux_layer_ids_internal": aux, "sglang_aux_offset": convention,
              "formats": records}
    atomic_write_json(stage.dir / "report.json", report)
    stage.write_manifest(
        inputs={"checkpoint": str(ckpt), "upstream_manifest_sha256": source[
            "upstream_manifest_sha256"]},
        outputs={fmt: str(stage.dir / fmt) for fmt in records} | {
            "report": str(stage.dir / "report.json")},
        counts={"formats": len(records),
                "keys": {fmt: r["num_keys"] for fmt, r in records.items()},
                "parameters": next(iter(records.values()))["num_parameters"] if records else 0},
        started=started,
        aux_layer_ids={fmt: r["aux_layer_ids_written"] for fmt, r in records.items()},
    )
