"""`05_fix_keys.py --from`: any EAGLE-3 drafter directory -> validated directories for every
engine format, outside any run.

    python 05_fix_keys.py --from DRAFTER_DIR --out DIR [--verifier PATH]
                          [--formats vllm,sglang,speculators] [--dtype bfloat16]
                          [--source-sglang pre-25454|post-25454] [--sglang-aux-ids auto|...]

The source (speculators `save_pretrained` output, SGLang/SpecForge/AQ-MedAI `midlayer.*`, vLLM
layout, ours; one file, shards or a `.bin` read weights-only) is read by eagle3.base_drafter and
never written to; `DIR/<fmt>/` is made by the same code as stage 05 (eagle3.export), one tensor
in memory at a time, and `DIR/report.json` lists what was checked and what could not be.

Aux ids: the source's config writes them in its engine's convention; SGLang's depends on the
verifier's architecture and, for DeepSeek/Kimi verifiers, on whether the drafter was made for
SGLang before or after PR #25454 (docs/engines.md, "Aux-layer ids"). When the two readings
differ, `--source-sglang` must say which (or measure it: `04_train.py` with
`train.base_aux_convention=measure`). Without `--verifier`, what needs the verifier (its
embedding, vocabulary and hidden size, layer count) is reported as unchecked.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3 import base_drafter, formats
from eagle3.cli import setup_logging
from eagle3.config import ConfigError, read_verifier_config, text_config
from eagle3.export import Drafter, export_all
from eagle3.model_card import directory_provenance
from eagle3.runs import StageError, atomic_write_json
from eagle3.weights_io import TensorLike

log = logging.getLogger("eagle3")

ALL_FORMATS = ("vllm", "sglang", "speculators")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="05_fix_keys.py --from", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="the drafter directory to convert")
    ap.add_argument("--out", required=True, help="where DIR/<format>/ directories are written")
    ap.add_argument("--verifier", help="the verifier's directory: checks the drafter against it")
    ap.add_argument("--formats",
                    help="comma-separated: vllm, sglang, speculators (default: every format "
                         "the drafter can take: all but speculators for an MLA drafter)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="cast float weights (default: as stored)")
    ap.add_argument("--source-sglang", choices=formats.SGLANG_VERSIONS,
                    help="the SGLang a midlayer.* source was made for, when it matters")
    ap.add_argument("--sglang-aux-ids", choices=("auto", *formats.SGLANG_VERSIONS),
                    default="auto", help="the SGLang the sglang export must serve on")
    ap.add_argument("--speculative-tokens", type=int, default=3,
                    help="draft depth written in the speculators config")
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    return ap.parse_args(argv)


def _paths(src: str, out: str) -> tuple[Path, Path]:
    s, o = Path(src).expanduser().resolve(), Path(out).expanduser().resolve()
    if o == s or s in o.parents or o in s.parents:
        raise StageError(f"--out {o} overlaps --from {s}: the source is never written to; give "
                         f"a separate directory")
    return s, o


def _source_config(src: Path) -> dict[str, Any]:
    try:
        return json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _verifier_facts(args: argparse.Namespace, src_cfg: dict[str, Any]
                    ) -> tuple[Optional[str], Optional[str]]:
    """(verifier path or hub id, its architecture): from --verifier, else what the source's
    speculators config names."""
    if args.verifier:
        path = Path(args.verifier).expanduser().resolve()
        return str(path), (read_verifier_config(path).get("architectures") or ["?"])[0]
    named = (src_cfg.get("speculators_config") or {}).get("verifier") or {}
    return named.get("name_or_path"), (named.get("architectures") or [None])[0]


def _internal_aux(base: base_drafter.BaseDrafter, arch: Optional[str],
                  source_sglang: Optional[str]) -> list[int]:
    if base.aux_layer_ids is None:
        raise StageError(f"{base.path}/config.json names no aux layer ids "
                         f"(eagle_aux_hidden_state_layer_ids): the layers it was trained on "
                         f"are unknown")
    if base.layout != "sglang":
        return list(base.aux_layer_ids)
    if arch is None:
        raise StageError("the source is in SGLang's layout, whose aux ids depend on the "
                         "verifier's architecture: pass --verifier PATH")
    readings = {v: base.aux_ids_internal(arch, v) for v in formats.SGLANG_VERSIONS}
    if source_sglang:
        return readings[source_sglang]
    if len({tuple(r) for r in readings.values()}) > 1:
        raise StageError(
            f"the source's aux ids {base.aux_layer_ids} mean layers {readings['pre-25454']} on "
            f"SGLang before PR #25454 and {readings['post-25454']} after it for a {arch} "
            f"verifier: say which SGLang the drafter was made for with --source-sglang "
            f"pre-25454|post-25454 (AQ-MedAI's Kimi drafters predate it), or measure it with "
            f"04_train.py train.base_aux_convention=measure")
    return readings["post-25454"]


def _vocab_maps(base: base_drafter.BaseDrafter, notes: list[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the source (`base_drafter.vocab_maps`), with a note when implied."""
    maps = base_drafter.vocab_maps(base)
    if base.d2t is None:
        notes.append("no d2t/t2d in the source: a full-vocabulary drafter (identity map), "
                     "none written")
    return maps


def _problems(base: base_drafter.BaseDrafter, maps: tuple[torch.Tensor, torch.Tensor],
              verifier: Optional[str], internal: list[int], unchecked: list[str]) -> list[str]:
    """Everything that makes the source unfit to ship, one line each."""
    shape = base.shape
    problems = list(base.unsupported_flags)
    problems += [f"source {p}" for p in formats.vocab_map_problems(
        maps[0], maps[1], shape.draft_vocab_size, shape.vocab_size)]
    if "lm_head.weight" not in base.weights:
        problems.append(f"`lm_head.weight` missing: engines would score its "
                        f"{shape.draft_vocab_size}-token draft vocabulary with the verifier's "
                        f"full head (sglang#27829); export from the training checkpoint that "
                        f"has it")
    expected = formats.expected_tensors(shape, "speculators")
    present = {k: v for k, v in base.weights.items() if k != "lm_head.weight"}
    for key in ("d2t", "t2d", "lm_head.weight"):  # checked above
        expected.pop(key, None)
    problems += formats.tensor_problems(expected, present)
    if verifier is None:
        problems += base_drafter.verifier_fit_problems(shape, None, None)
        unchecked += ["the embedding against the verifier's (no --verifier)",
                      "vocabulary size, hidden size and aux layers against the verifier "
                      "(no --verifier)"]
        if base.embed is not None:
            unchecked.append("the source ships `embed_tokens`: not shipped in the exports "
                             "(engines use the verifier's); unverified that they are equal")
        return problems
    from eagle3.verifier import lazy_tensor

    text = text_config(read_verifier_config(Path(verifier)))
    vocab, hidden, layers = (text.get(k) for k in ("vocab_size", "hidden_size",
                                                   "num_hidden_layers"))
    # The check stage 04 makes of a --finetune-from base, so both refuse the same drafters.
    problems += base_drafter.verifier_fit_problems(shape, hidden, vocab)
    bad = [i for i in internal if not 1 <= i <= (layers or 0)]
    if bad:
        problems.append(f"aux layers {bad} outside the verifier's 1..{layers}")
    if base.embed is not None:
        problems += base_drafter.embedding_problems(base.embed,
                                                    lazy_tensor(Path(verifier), "embed"))
    return problems


def run_convert(args: argparse.Namespace) -> dict[str, Any]:
    src, out = _paths(args.src, args.out)
    base = base_drafter.load(src)
    if args.formats is None:
        fmts = [f for f in ALL_FORMATS
                if not (f == "speculators" and base.shape.attention == "mla")]
    else:
        fmts = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in fmts:
        formats.get_format(f)
    verifier, arch = _verifier_facts(args, _source_config(src))
    if arch is None and ("sglang" in fmts or "speculators" in fmts):
        raise StageError("the SGLang and speculators exports need the verifier (SGLang's aux-id "
                         "convention depends on its architecture; speculators names it): pass "
                         "--verifier PATH, or --formats vllm")
    internal = _internal_aux(base, arch, args.source_sglang)
    notes: list[str] = []
    unchecked: list[str] = []
    d2t, t2d = _vocab_maps(base, notes)
    problems = _problems(base, (d2t, t2d), verifier if args.verifier else None, internal,
                         unchecked)
    if problems:
        raise base_drafter.BaseDrafterError(src, problems)
    weights: dict[str, TensorLike] = dict(base.weights)
    if not base.shape.full_vocab:  # a full vocabulary ships no map (docs/engines.md)
        weights.update(d2t=d2t, t2d=t2d)
    drafter = Drafter(src, base.shape, internal, weights)
    ctx = formats.ExportContext(verifier_path=verifier or "", verifier_arch=arch or "",
                                speculative_tokens=args.speculative_tokens,
                                sglang_rule=args.sglang_aux_ids)
    identity = {str(p.relative_to(src)): [p.stat().st_size, p.stat().st_mtime_ns]
                for p in sorted(src.iterdir()) if p.is_file()}
    source = {"from": str(src), "files": identity, "verifier": verifier, "dtype": args.dtype,
              "source_sglang": args.source_sglang, "sglang_aux_ids": args.sglang_aux_ids,
              "speculative_tokens": args.speculative_tokens}
    provenance = directory_provenance(src, verifier)
    provenance["trust_remote_code"] = bool(provenance.get("trust_remote_code")) or (
        bool(args.verifier) and _remote_code(Path(verifier)))
    records = export_all(out, fmts, drafter, ctx, source, args.dtype, provenance, "sha256")
    report = {"from": str(src), "layout": base.layout, "verifier": verifier,
              "verifier_architecture": arch, "aux_layer_ids_written_in_source":
              base.aux_layer_ids, "aux_layer_ids_internal": internal,
              "draft_config": base.shape.to_dict(), "notes": notes, "unchecked": unchecked,
              "provenance": provenance, "formats": records}
    atomic_write_json(out / "report.json", report)
    return report


def _remote_code(verifier: Path) -> bool:
    """Whether the verifier needs --trust-remote-code (its config maps auto classes)."""
    try:
        return bool(json.loads((verifier / "config.json").read_text()).get("auto_map"))
    except (OSError, ValueError):
        return False


def convert_main(argv: list[str]) -> int:
    args = _parse(argv)
    setup_logging()
    try:
        report = run_convert(args)
    except (ConfigError, StageError, formats.FormatError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    for fmt, r in report["formats"].items():
        print(f"{Path(args.out) / fmt}: {r['num_keys']} tensors, aux ids "
              f"{r['aux_layer_ids_written']} (valid on {', '.join(r['aux_ids_valid_for'])})")
    for line in report["notes"]:
        print(f"note: {line}")
    for line in report["unchecked"]:
        print(f"unchecked: {line}")
    return 0
