"""The README.md each export carries: what a user pushing the directory to a model hub needs.

    text = model_card(fmt, record, provenance, export_dir, siblings)

`record` is the export's validation summary (eagle3.formats.validate_export: aux ids in the
engine's convention, the SGLang versions they are valid for, shapes); `provenance` says where
the drafter came from (`run_provenance` for stage 05 of a run, `directory_provenance` for
`05_fix_keys.py --from`): verifier, draft vocabulary and coverage, training data and steps,
and the acceptance stage 06 measured, when it has. The serve commands are built by the same
code stage 06 launches engines with (`eagle3.bench.engine_args`), for this directory and for
the sibling export of the other engine.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Optional

ENGINE_OF = {"vllm": "vllm", "speculators": "vllm", "sglang": "sglang"}


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def measured_acceptance(run_dir: Path) -> list[dict[str, Any]]:
    """Stage 06's speculative cells of a run (engine, depth, concurrency, prompt set,
    temperature, mean acceptance length, speed-up), when it has finished."""
    results = _read_json(run_dir / "06_bench" / "results.json") or {}
    rows = []
    for r in results.get("results", []):
        if r.get("depth") and r.get("mean_acceptance_length") is not None:
            rows.append({k: r.get(k) for k in ("engine", "run", "concurrency", "prompt_set",
                                               "temperature", "mean_acceptance_length",
                                               "speedup")})
    return rows


def run_provenance(cfg: Any, checkpoint: Path, step: Optional[int]) -> dict[str, Any]:
    """Where a run's drafter came from, read from the run's own manifests."""
    run = cfg.run_dir
    vocab = (_read_json(run / "03_vocab" / "manifest.json") or {}).get("counts", {})
    train = (_read_json(run / "04_train" / "manifest.json") or {}).get("counts", {})
    sources = [s.path for s in cfg.data.source_configs]
    return {
        "verifier": str(cfg.verifier_path.resolve()),
        "checkpoint": str(checkpoint),
        "training": {"data": sources, "num_samples": cfg.data.num_samples,
                     "regenerated_by_verifier": cfg.generate.engine, "step": step,
                     "epochs": cfg.train.epochs, "train_samples": train.get("train_samples"),
                     "tokens_seen": train.get("tokens_seen"),
                     "best_val_est_accept_len": train.get("best_val_est_accept_len"),
                     "finetuned_from": cfg.train.finetune_from},
        "vocab": {"coverage": vocab.get("coverage")},
        # Stage 06 runs after this export (and must never find its input changed under it):
        # its figures reach a card through `05_fix_keys.py --from` this export.
        "acceptance": [],
        "trust_remote_code": cfg.verifier.trust_remote_code,
        "verifier_mla": cfg.verifier_info.mla,
        # How stage 06 has the engine draft at T > 0 (vLLM's draft_sample_method): the serve
        # command should draft the way the drafter was trained and measured.
        "draft_sample": {e.name: e.draft_sample for e in cfg.bench.engines},
        # The verifier's tensor parallelism stage 06 serves it with: a serve command without
        # it does not fit a 1T-parameter verifier on one GPU.
        "tp": {e.name: e.tp for e in cfg.bench.engines if e.tp},
    }


def directory_provenance(src: Path, verifier: Optional[str]) -> dict[str, Any]:
    """Where a drafter directory came from: its own export record when this pipeline wrote it
    (then the run it came from, and that run's stage 06 figures), else only its path."""
    record = _read_json(src / "eagle3_export.json") or {}
    ckpt = (record.get("source") or {}).get("checkpoint")
    out: dict[str, Any] = {"verifier": verifier, "converted_from": str(src), "training": {},
                           "vocab": {}, "acceptance": [], "verifier_mla": verifier_mla(verifier)}
    if ckpt:
        run = Path(ckpt).parent.parent  # <run>/04_train/step-N
        out["checkpoint"] = ckpt
        made = (_read_json(run / "05_export" / "report.json") or {}).get("provenance") or {}
        out["training"], out["vocab"] = made.get("training", {}), made.get("vocab", {})
        out["trust_remote_code"] = made.get("trust_remote_code", False)
        out["draft_sample"] = made.get("draft_sample", {})
        if out["verifier_mla"] is None:  # the verifier is not here: the run knew
            out["verifier_mla"] = made.get("verifier_mla")
        out["acceptance"] = measured_acceptance(run)
    return out


def verifier_mla(verifier: Optional[str]) -> Optional[bool]:
    """Whether the verifier uses multi-head latent attention (as VerifierInfo.mla); None when
    its config.json is not readable here."""
    from eagle3.config import ConfigError, read_verifier_config, text_config, uses_mla

    if not verifier:
        return None
    try:
        return uses_mla(text_config(read_verifier_config(Path(verifier))))
    except ConfigError:
        return None


def serve_commands(fmt: str, export_dir: Path, siblings: dict[str, Path], verifier: str,
                   trust_remote_code: bool, draft_sample: Optional[dict[str, str]] = None,
                   depth: int = 3, mla: Optional[bool] = None,
                   tp: Optional[dict[str, int]] = None, full_vocab: bool = False
                   ) -> dict[str, str]:
    """Engine -> the command that serves the verifier with this drafter (or its sibling export
    for the other engine), with stage 06's own flags at a chain of `depth` and the run's way of
    drafting at T > 0 (`draft_sample`: engine -> bench.engines[].draft_sample; SGLang samples
    only a `full_vocab` head's drafts). SGLang gets the
    drafter its own attention backend unless the verifier is known not to be MLA (`mla`): on
    Blackwell an MLA verifier's trtllm_mla would stop the drafter, and on NVIDIA GPUs flashinfer
    serves any Llama-layer drafter (docs/engines.md, "The drafter's attention backend")."""
    from eagle3.bench import engine_args
    from eagle3.config import (MLA_DRAFT_BACKEND_ARGS, BenchEngineConfig, Depth,
                               drafting_at_temperature)

    out = {}
    dirs = {ENGINE_OF[f]: d for f, d in siblings.items() if f != "speculators"}
    dirs[ENGINE_OF[fmt]] = export_dir
    remote = ["--trust-remote-code"] if trust_remote_code else []
    for engine, d in sorted(dirs.items()):
        sample = drafting_at_temperature(engine, (draft_sample or {}).get(engine, "greedy"),
                                         full_vocab)
        flags = engine_args(BenchEngineConfig(name=engine, draft_sample=sample,
                                              tp=(tp or {}).get(engine)),
                            Depth(depth, 1, depth + 1), d, 1, metrics=False)
        head = (["vllm", "serve", verifier] if engine == "vllm" else
                ["python", "-m", "sglang.launch_server", "--model-path", verifier])
        if engine == "sglang" and mla is not False:
            flags += MLA_DRAFT_BACKEND_ARGS
        out[engine] = shlex.join(head + flags + remote)
    if fmt == "speculators":  # the verifier is named in the config
        alone = ["vllm", "serve", str(export_dir)]
        if (tp or {}).get("vllm"):
            alone += ["--tensor-parallel-size", str(tp["vllm"])]
        out["vllm (this directory alone)"] = shlex.join(alone + remote)
    return out


LAYER_WORDS = {"mha": "Llama (multi-head attention)",
               "mla": "MLA (DeepSeek-V2 multi-head latent attention)"}


def model_card(fmt: str, record: dict[str, Any], provenance: dict[str, Any], export_dir: Path,
               siblings: dict[str, Path]) -> str:
    verifier = provenance.get("verifier") or "<verifier path>"
    shapes = record["shapes"]
    draft_vocab, vocab = shapes["lm_head.weight"][0], record["vocab_size"]
    train = provenance.get("training") or {}
    lines = [
        f"# EAGLE-3 drafter for {Path(verifier).name} ({fmt} layout)", "",
        f"A one-layer EAGLE-3 draft model for speculative decoding with `{verifier}`, in the "
        f"layout {'SGLang' if fmt == 'sglang' else 'vLLM'} loads"
        f"{' (speculators format)' if fmt == 'speculators' else ''}.", "",
        "| | |", "|---|---|",
        f"| verifier | `{verifier}` |",
        f"| aux layers (HF `output_hidden_states` indices) | {record['aux_layer_ids_internal']} |",
        f"| aux ids written in this config | {record['aux_layer_ids_written']} "
        f"({', '.join(record['aux_ids_valid_for'])}) |",
        f"| draft vocabulary | {draft_vocab} of {vocab} tokens"
        + (" (the full vocabulary: no d2t/t2d)" if draft_vocab == vocab else "")
        + (f", covering {provenance['vocab']['coverage']:.1%} of the training answers' tokens"
           if (provenance.get("vocab") or {}).get("coverage") is not None else "") + " |",
        f"| draft layer | {LAYER_WORDS[record.get('attention', 'mha')]} |",
        f"| parameters | {record['num_parameters'] / 1e6:.1f}M ({', '.join(record['dtypes'])}; "
        f"no embedding: the engine uses the verifier's) |",
    ]
    if train:
        data = ", ".join(str(d) for d in train.get("data") or []) or "?"
        lines.append(f"| training data | {data}: {train.get('train_samples') or '?'} "
                     f"conversations, answers regenerated by the verifier "
                     f"({train.get('regenerated_by_verifier')}) |")
        lines.append(f"| training | step {train.get('step')}, {train.get('tokens_seen') or '?'} "
                     f"tokens, {train.get('epochs')} epochs"
                     + (f", fine-tuned from `{train['finetuned_from']}`"
                        if train.get("finetuned_from") else "") + " |")
    if provenance.get("converted_from"):
        lines.append(f"| converted from | `{provenance['converted_from']}` |")
    lines += ["", "## Measured acceptance", ""]
    rows = provenance.get("acceptance") or []
    if rows:
        lines += ["| engine | depth | concurrency | prompts | T | acceptance length | "
                  "speed-up |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['engine']} | {r['run']} | {r['concurrency']} | {r['prompt_set']} | "
                  f"{r['temperature']:g} | {r['mean_acceptance_length']:.3f} | "
                  + (f"{r['speedup']:.2f}x" if r.get("speedup") else "-") + " |" for r in rows]
    else:
        lines.append("Not measured yet: run `06_deploy_and_bench.py`, then export again with "
                     "`05_fix_keys.py --from` this directory to carry the figures here.")
    lines += ["", "## Serve", ""]
    # an MLA drafter is an MLA model to SGLang: it runs on whatever backend the verifier gets
    mla = False if record.get("attention") == "mla" else provenance.get("verifier_mla")
    commands = serve_commands(fmt, export_dir, siblings, verifier,
                              bool(provenance.get("trust_remote_code")),
                              provenance.get("draft_sample"), mla=mla,
                              tp=provenance.get("tp"), full_vocab=draft_vocab == vocab)
    for engine, cmd in commands.items():
        lines += [f"{engine}:", "", "```bash", cmd, "```", ""]
    if "sglang" in commands and mla is not False:
        lines += ["SGLang runs the drafter on its own attention backend (`--speculative-draft-"
                  "attention-backend flashinfer`): on Blackwell it gives an MLA verifier "
                  "trtllm_mla, which this Llama-layer drafter cannot run.", ""]
    if (provenance.get("draft_sample") or {}).get("vllm") == "probabilistic":
        lines += ["vLLM drafts by sampling here (`draft_sample_method`): at T > 0 it accepts "
                  "with min(1, p/q), what this drafter was measured with. SGLang drafts it "
                  "greedily only.", ""]
    if fmt == "sglang":
        lines.append("The aux ids above are in SGLang's convention for this verifier: serve "
                     "with vLLM from the vLLM export, not from this directory.")
    return "\n".join(lines).rstrip() + "\n"
