"""Checkpoint layouts of an EAGLE-3 drafter: key maps, engine configs, detection, validation.

Owns every fact about what vLLM, SGLang and speculators load (REFERENCE.md sections 1-3, 6):

- key maps as data: speculators/vLLM `layers.0.*` <-> SGLang/EAGLE `midlayer.*` (one dict and
  its derived inverse), and `strip_compile_prefix` for torch.compile's `_orig_mod.`;
- the config.json each format needs (`speculators_config`, `vllm_config`, `sglang_config`),
  with aux ids converted from the internal convention (HF `output_hidden_states` index);
- `write_export` (state dict + config -> directory) and `validate_export`, which reads a
  written directory back from disk and raises `ExportValidationError` listing every problem
  that would make an engine load wrong weights silently.

    from eagle3.formats import write_export, validate_export
    write_export(out_dir, "sglang", state_dict, draft_cfg, aux_ids, verifier_path, "Llama...")
    report = validate_export(out_dir, "sglang", draft_cfg, aux_ids)

Used by stage 05 (`eagle3/export.py`) and by the training checkpoint writer (config.json of
`step-N/` is `speculators_config(...)`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.model import DraftModelConfig, Eagle3DraftModel

Format = Literal["vllm", "sglang", "speculators"]
Layout = Literal["speculators", "sglang"]
SglangConvention = Literal["post-25454", "pre-25454"]

FORMATS: tuple[str, ...] = ("vllm", "sglang", "speculators")
ENGINE_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3DraftModel"
SPECULATORS_VERSION = "0.9.0"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Key prefixes, speculators/vLLM-internal -> SGLang/EAGLE-official. SGLang builds only
# `model.midlayer` for layer 0; its extra layers (`additional_layers.{i-1}`) drop the residual
# coming out of the midlayer and use `hidden_norm` as their input norm, so a multi-layer drafter
# trained as plain Llama layers cannot be expressed there (see `sglang_key_map`).
SPECULATORS_TO_SGLANG: dict[str, str] = {"layers.0.": "midlayer."}
SGLANG_TO_SPECULATORS: dict[str, str] = {v: k for k, v in SPECULATORS_TO_SGLANG.items()}

# Which key layout each format ships. vLLM loads both (it maps midlayer. -> layers.0.), we
# ship its own internal names; speculators only knows `layers.N.`.
FORMAT_LAYOUT: dict[str, Layout] = {"vllm": "speculators", "sglang": "sglang",
                                    "speculators": "speculators"}
# Layouts the validator accepts per format (a hand-made vLLM dir with midlayer keys is fine).
ACCEPTED_LAYOUTS: dict[str, tuple[Layout, ...]] = {"vllm": ("speculators", "sglang"),
                                                   "sglang": ("sglang",),
                                                   "speculators": ("speculators",)}

COMPILE_PREFIX = "_orig_mod."
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


class FormatError(ValueError):
    """A drafter cannot be written in the requested format (one line: what and how to fix)."""


class ExportValidationError(ValueError):
    """An exported directory would load wrong in its engine; `problems` lists every issue."""

    def __init__(self, directory: Path, fmt: str, problems: list[str]):
        self.directory = directory
        self.fmt = fmt
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{fmt} export {directory} failed validation "
                         f"({len(problems)} problem(s)):\n{lines}")


# ---------------------------------------------------------------------------------------------
# Key maps


def strip_compile_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the `_orig_mod.` prefix torch.compile puts on every parameter of a compiled model."""
    return {k.replace(COMPILE_PREFIX, "", 1) if k.startswith(COMPILE_PREFIX) else k: v
            for k, v in state.items()}


def _rename(state: Mapping[str, torch.Tensor], prefix_map: Mapping[str, str]
            ) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for old, new in prefix_map.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def to_sglang_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators layout (`layers.0.*`) -> SGLang layout (`midlayer.*`); 1-layer drafters only."""
    deeper = sorted({m.group(0) for k in state if (m := _LAYER_KEY.match(k))
                     and m.group(1) != "0"})
    if deeper:
        raise FormatError(
            f"SGLang serves one draft layer only (its additional_layers drop the midlayer "
            f"residual and have no input_layernorm), but the drafter has {deeper}: train with "
            f"draft.num_layers=1 or drop `sglang` from export.formats")
    return _rename(state, SPECULATORS_TO_SGLANG)


def to_speculators_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGLang/EAGLE layout (`midlayer.*`) -> speculators layout (`layers.0.*`)."""
    return _rename(state, SGLANG_TO_SPECULATORS)


def detect_layout(keys: Any) -> Layout:
    """`speculators` (layers.N.*) or `sglang` (midlayer.*); raises on neither or a mix."""
    keys = list(keys)
    has_layers = any(_LAYER_KEY.match(k) for k in keys)
    has_mid = any(k.startswith("midlayer.") for k in keys)
    if has_layers and has_mid:
        raise FormatError("state dict mixes `layers.N.*` and `midlayer.*` keys: not a drafter "
                          "checkpoint of one layout")
    if has_mid:
        return "sglang"
    if has_layers:
        return "speculators"
    raise FormatError("state dict has neither `layers.N.*` nor `midlayer.*` keys: no decoder "
                      "layer, not an EAGLE-3 drafter checkpoint")


def expected_tensors(draft: DraftModelConfig, layout: Layout = "speculators"
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Key -> (shape, required dtype or None for any float) of a shipped drafter.

    Built from `Eagle3DraftModel` itself (on the meta device, no memory), so it can never drift
    from the model the trainer saves.
    """
    with torch.device("meta"):
        model = Eagle3DraftModel(draft)
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for key, tensor in model.trainable_state_dict().items():
        dtype = tensor.dtype if key in ("d2t", "t2d") else None
        out[key] = (tuple(tensor.shape), dtype)
    if layout == "sglang":
        if draft.num_layers != 1:
            raise FormatError(f"SGLang serves one draft layer only, config has "
                              f"num_layers={draft.num_layers}")
        out = _rename(out, SPECULATORS_TO_SGLANG)  # type: ignore[arg-type]
    return out


# ---------------------------------------------------------------------------------------------
# Aux-layer ids per engine


def sglang_aux_ids(aux_layer_ids: list[int], convention: SglangConvention) -> list[int]:
    """Internal ids (HF `output_hidden_states` index) -> what SGLang's config must say.

    post-25454 SGLang captures `hidden_states[id]` unless the first id is 1, in which case it
    adds +1 to all ids (the old SpecForge convention); pre-25454 SGLang always adds +1.
    """
    ids = list(aux_layer_ids)
    if convention == "post-25454":
        if ids and ids[0] == 1:
            raise FormatError(
                f"aux ids {ids} start with 1: post-25454 SGLang adds +1 to every id when the "
                f"first is 1 and would capture {[i + 1 for i in ids]}; no config expresses "
                f"these ids there. Capture from layer >= 2, or set "
                f"export.sglang_aux_offset=pre-25454 for an older SGLang")
        return ids
    if convention == "pre-25454":
        if min(ids) < 1:
            raise FormatError(f"aux ids {ids} include 0 (the embeddings): pre-25454 SGLang "
                              f"adds +1 to every id and cannot capture it")
        return [i - 1 for i in ids]
    raise FormatError(f"unknown SGLang aux convention {convention!r}: use post-25454 or "
                      f"pre-25454")


# ---------------------------------------------------------------------------------------------
# Config layouts


def _llama_fields(draft: DraftModelConfig) -> dict[str, Any]:
    """Plain Llama fields of the draft layer, readable by transformers 4 and 5."""
    return {
        "model_type": "llama",
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_hidden_layers": draft.num_layers,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": draft.rms_norm_eps,
        "max_position_embeddings": draft.max_position_embeddings,
        # transformers 5 reads `rope_parameters` (and folds a top-level rope_theta into it);
        # transformers 4 and older engine code read `rope_theta`. Write both, same value.
        "rope_theta": float(draft.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(draft.rope_theta)},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": draft.vocab_size,
    }


def _eagle_fields(draft: DraftModelConfig) -> dict[str, Any]:
    # Written explicitly: vLLM's speculators path defaults norm_before_residual to True, the
    # Llama path to False; the EAGLE-3.1 flags are off in our model and must not be guessed.
    return {
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": draft.target_hidden_size,
        "norm_before_residual": bool(draft.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }


def _check_aux(draft: DraftModelConfig, aux_layer_ids: list[int]) -> list[int]:
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != draft.num_aux:
        raise FormatError(f"{len(ids)} aux layer ids {ids} but the drafter's fc takes "
                          f"num_aux={draft.num_aux} states")
    if ids != sorted(set(ids)):
        raise FormatError(f"aux layer ids {ids} must be distinct and ascending (engines "
                          f"concatenate aux states in layer order)")
    return ids


def speculators_config(draft: DraftModelConfig, aux_layer_ids: list[int], verifier_path: str,
                       verifier_arch: str, speculative_tokens: int = 3) -> dict[str, Any]:
    """config.json in the speculators 0.9 layout (`layers.0.*` keys; `vllm serve DIR` works).

    `verifier_path` is what vLLM starts as the verifier when served as-is.
    """
    ids = _check_aux(draft, aux_layer_ids)
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        **_eagle_fields(draft),
        "eagle_aux_hidden_state_layer_ids": ids,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "transformer_layer_config": _llama_fields(draft),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(verifier_path),
                         "architectures": [verifier_arch]},
        },
    }


def vllm_config(draft: DraftModelConfig, aux_layer_ids: list[int]) -> dict[str, Any]:
    """config.json for vLLM's `Eagle3LlamaForCausalLM` (launched with --speculative-config).

    Aux ids are vLLM's "capture before layer j" = the internal convention, written both
    top-level (all vLLM versions) and in `eagle_config` (newer ones, and vLLM sizes `fc` from
    its length).
    """
    ids = _check_aux(draft, aux_layer_ids)
    return {
        "architectures": [ENGINE_ARCH],
        **_llama_fields(draft),
        **_eagle_fields(draft),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }


def sglang_config(draft: DraftModelConfig, aux_layer_ids: list[int],
                  convention: SglangConvention = "post-25454") -> dict[str, Any]:
    """config.json for SGLang's `LlamaForCausalLMEagle3` (`midlayer.*` keys).

    SGLang reads aux ids only from `eagle_config`, in its version's convention; no top-level
    ids are written so that no other reader takes shifted ids at face value.
    """
    ids = _check_aux(draft, aux_layer_ids)
    if draft.num_layers != 1:
        raise FormatError(f"SGLang serves one draft layer only, the drafter has "
                          f"{draft.num_layers}: train with draft.num_layers=1 or drop sglang "
                          f"from export.formats")
    if draft.num_aux != 3:
        raise FormatError(f"SGLang's fc is fixed at 3 aux states, the drafter has "
                          f"num_aux={draft.num_aux}")
    if draft.norm_before_residual:
        raise FormatError("SGLang has no norm_before_residual=true variant: train with "
                          "draft.norm_before_residual=false or drop sglang from export.formats")
    return {
        "architectures": [ENGINE_ARCH],
        **_llama_fields(draft),
        **_eagle_fields(draft),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(ids, convention),
                         "use_aux_hidden_state": True},
    }


def engine_aux_ids(fmt: str, aux_layer_ids: list[int],
                   sglang_convention: SglangConvention = "post-25454") -> list[int]:
    """The aux ids as written into `fmt`'s config (internal convention in, engine's out)."""
    if fmt == "sglang":
        return sglang_aux_ids(list(aux_layer_ids), sglang_convention)
    return [int(i) for i in aux_layer_ids]


def aux_convention(fmt: str, sglang_convention: SglangConvention = "post-25454") -> str:
    """One line naming the convention of `engine_aux_ids(fmt, ...)`, for reports."""
    if fmt == "sglang":
        if sglang_convention == "pre-25454":
            return "SGLang pre-#25454: engine adds +1, written as HF hidden_states index - 1"
        return "SGLang post-#25454: as-is = HF output_hidden_states index (first id != 1)"
    return "capture before layer j = HF output_hidden_states index (used as-is)"


# ---------------------------------------------------------------------------------------------
# Writing


def export_state_dict(state: Mapping[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """A training state dict (any layout, maybe compiled) -> the keys `fmt` ships."""
    state = strip_compile_prefix(state)
    layout = detect_layout(state)
    canonical = to_speculators_keys(state) if layout == "sglang" else dict(state)
    canonical = {k: v for k, v in canonical.items() if not k.startswith("embed_tokens.")}
    if FORMAT_LAYOUT[fmt] == "sglang":
        return to_sglang_keys(canonical)
    return canonical


def format_config(fmt: str, draft: DraftModelConfig, aux_layer_ids: list[int],
                  verifier_path: str, verifier_arch: str,
                  sglang_convention: SglangConvention = "post-25454",
                  speculative_tokens: int = 3) -> dict[str, Any]:
    if fmt == "vllm":
        return vllm_config(draft, aux_layer_ids)
    if fmt == "sglang":
        return sglang_config(draft, aux_layer_ids, sglang_convention)
    if fmt == "speculators":
        return speculators_config(draft, aux_layer_ids, verifier_path, verifier_arch,
                                  speculative_tokens)
    raise FormatError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")


def write_export(directory: Path, fmt: str, state: Mapping[str, torch.Tensor],
                 draft: DraftModelConfig, aux_layer_ids: list[int], verifier_path: str,
                 verifier_arch: str, sglang_convention: SglangConvention = "post-25454",
                 speculative_tokens: int = 3, dtype: Optional[str] = None) -> None:
    """Write config.json + model.safetensors of `fmt` into an existing (temporary) directory.

    `dtype` (e.g. "bfloat16") casts the float weights; d2t/t2d keep int64/bool.
    """
    config = format_config(fmt, draft, aux_layer_ids, verifier_path, verifier_arch,
                           sglang_convention, speculative_tokens)
    tensors = export_state_dict(state, fmt)
    if dtype is not None:
        target = getattr(torch, dtype)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    dtypes = {str(v.dtype).removeprefix("torch.") for k, v in tensors.items()
              if v.is_floating_point()}
    if len(dtypes) == 1:
        config["dtype"] = dtypes.pop()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors creates the file 0600; engines often run as another user (containers).
    os.chmod(directory / WEIGHTS_FILE, 0o644)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Validation (reads back what the engine will load)


def _draft_config_problems(fmt: str, cfg: dict[str, Any], draft: DraftModelConfig,
                           written_ids: list[int]) -> list[str]:
    """Config fields missing or inconsistent with the drafter the weights came from."""
    problems: list[str] = []
    if fmt == "speculators":
        arch_ok = cfg.get("architectures") == [SPECULATORS_ARCH]
        want_arch = [SPECULATORS_ARCH]
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            problems.append("config: `transformer_layer_config` missing (vLLM refuses a "
                            "speculators config without it)")
            layer = {}
        if cfg.get("speculators_model_type") != "eagle3":
            problems.append("config: `speculators_model_type` must be \"eagle3\"")
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        if not isinstance(methods[0].get("speculative_tokens"), int):
            problems.append("config: `speculators_config.proposal_methods[0]."
                            "speculative_tokens` missing")
        if not (spec.get("verifier") or {}).get("name_or_path"):
            problems.append("config: `speculators_config.verifier.name_or_path` missing "
                            "(vLLM serves this verifier)")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        ids_where = "eagle_aux_hidden_state_layer_ids"
    else:
        arch_ok = cfg.get("architectures") == [ENGINE_ARCH]
        want_arch = [ENGINE_ARCH]
        layer = cfg
        eagle = cfg.get("eagle_config") or {}
        if fmt == "vllm":
            ids = cfg.get("eagle_aux_hidden_state_layer_ids")
            ids_where = "eagle_aux_hidden_state_layer_ids"
            nested = eagle.get("eagle_aux_hidden_state_layer_ids")
            if nested is not None and nested != ids:
                problems.append(f"config: eagle_config ids {nested} differ from top-level "
                                f"ids {ids}")
        else:
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
            ids_where = "eagle_config.eagle_aux_hidden_state_layer_ids"
            if "eagle_aux_hidden_state_layer_ids" in cfg:
                problems.append("config: top-level eagle_aux_hidden_state_layer_ids in an "
                                "SGLang export (SGLang ignores it; other readers would take "
                                "SGLang-convention ids at face value)")
        if cfg.get("tie_word_embeddings") is not False:
            problems.append("config: `tie_word_embeddings` must be false (true makes the "
                            "engine use the embedding as lm_head)")
    if not arch_ok:
        problems.append(f"config: `architectures` is {cfg.get('architectures')!r}, must be "
                        f"{want_arch}")
    if not ids:
        problems.append(f"config: aux ids `{ids_where}` absent (engines fall back to default "
                        f"layers silently)")
    elif list(ids) != list(written_ids):
        problems.append(f"config: `{ids_where}` is {ids}, expected {written_ids}")
    if "norm_before_residual" not in cfg:
        problems.append("config: `norm_before_residual` absent (vLLM's speculators path "
                        "defaults it to true, its Llama path to false): write it explicitly")
    elif cfg["norm_before_residual"] is not bool(draft.norm_before_residual):
        problems.append(f"config: norm_before_residual={cfg['norm_before_residual']} but the "
                        f"drafter was trained with {draft.norm_before_residual}")
    if fmt == "sglang" and cfg.get("norm_before_residual") is True:
        problems.append("config: SGLang cannot serve norm_before_residual=true")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag):
            problems.append(f"config: `{flag}` is true; this drafter has no such norm")
    want = {"draft_vocab_size": (cfg, draft.draft_vocab_size),
            "target_hidden_size": (cfg, draft.target_hidden_size),
            "vocab_size": (layer, draft.vocab_size),
            "hidden_size": (layer, draft.hidden_size),
            "intermediate_size": (layer, draft.intermediate_size),
            "num_hidden_layers": (layer, draft.num_layers),
            "num_attention_heads": (layer, draft.num_attention_heads),
            "num_key_value_heads": (layer, draft.num_key_value_heads),
            "head_dim": (layer, draft.head_dim)}
    for name, (where, value) in want.items():
        if name not in where:
            problems.append(f"config: `{name}` missing (expected {value})")
        elif where[name] != value:
            problems.append(f"config: `{name}` is {where[name]}, expected {value}")
    theta = layer.get("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta"))
    if theta is None:
        problems.append("config: rope theta missing (`rope_theta` / `rope_parameters`)")
    elif float(theta) != float(draft.rope_theta):
        problems.append(f"config: rope theta {theta}, expected {draft.rope_theta}")
    return problems


def _vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int,
                        vocab: int) -> list[str]:
    """`d2t` must be offsets (target = i + d2t[i]) onto exactly the ids `t2d` marks."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        return []  # dtype/shape problems are reported by the key checks
    problems: list[str] = []
    targets = torch.arange(d2t.numel()) + d2t
    in_range = bool(((targets >= 0) & (targets < vocab)).all())
    increasing = bool((targets[1:] > targets[:-1]).all()) if targets.numel() > 1 else True
    marked = in_range and t2d.numel() == vocab and bool(t2d[targets.clamp(0, vocab - 1)].all())
    count = int(t2d.sum())
    if not (in_range and increasing and marked):
        hint = ""
        as_abs = d2t
        if (as_abs.numel() and bool(((as_abs >= 0) & (as_abs < vocab)).all())
                and t2d.numel() == vocab and bool(t2d[as_abs].all())):
            hint = ("; d2t holds absolute target ids: store offsets d2t[i] = target_id - i "
                    "(vLLM and SGLang compute target = i + d2t[i])")
        what = []
        if not in_range:
            what.append(f"i + d2t[i] leaves [0, {vocab})")
        if in_range and not increasing:
            what.append("targets i + d2t[i] are not strictly increasing")
        if in_range and not marked:
            what.append("some targets i + d2t[i] are not marked in t2d")
        problems.append(f"d2t: not valid offsets ({'; '.join(what)}){hint}")
    if count != draft_vocab:
        problems.append(f"t2d: marks {count} target ids, draft vocabulary has {draft_vocab}")
    return problems


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int,
                       vocab: int) -> list[str]:
    """Problems of a d2t/t2d pair (offsets onto exactly the ids t2d marks); [] when valid.

    Also used on a base drafter's map before fine-tuning from it (`eagle3.checkpoint`).
    """
    return _vocab_map_problems(d2t, t2d, draft_vocab, vocab)


def validate_export(directory: Path, fmt: str, draft: DraftModelConfig,
                    aux_layer_ids: list[int],
                    sglang_convention: SglangConvention = "post-25454") -> dict[str, Any]:
    """Check an exported directory as its engine will read it; return a summary for reports.

    `draft` and `aux_layer_ids` (internal convention) describe the drafter that was exported;
    raises ExportValidationError listing every problem found.
    """
    directory = Path(directory)
    problems: list[str] = []
    if fmt not in FORMATS:
        raise FormatError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    cfg_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    cfg: dict[str, Any] = {}
    if not cfg_path.is_file():
        problems.append(f"{CONFIG_FILE} missing")
    else:
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{CONFIG_FILE} is not valid JSON ({e})")
    if not weights_path.is_file():
        problems.append(f"{WEIGHTS_FILE} missing")
        raise ExportValidationError(directory, fmt, problems)

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    keys = set(tensors)

    written_ids = engine_aux_ids(fmt, aux_layer_ids, sglang_convention)
    if cfg:
        problems += _draft_config_problems(fmt, cfg, draft, written_ids)

    # Key-name hazards first: each one makes an engine fail or load random weights silently.
    for key in sorted(keys):
        if key.startswith("model."):
            problems.append(f"key `{key}` starts with `model.` (vLLM prefixes model. itself and "
                            f"fails; strip it)")
        if key.startswith(COMPILE_PREFIX):
            problems.append(f"key `{key}` carries torch.compile's `_orig_mod.` prefix")
    layer_keys = sorted(k for k in keys if _LAYER_KEY.match(k))
    if fmt == "sglang" and layer_keys:
        problems.append(f"SGLang export has `layers.N.*` keys {layer_keys[:3]}"
                        f"{'...' if len(layer_keys) > 3 else ''}: SGLang drops them silently "
                        f"(random weights); rename to `midlayer.*`")
    try:
        layout = detect_layout(k.removeprefix("model.").removeprefix(COMPILE_PREFIX)
                               for k in keys)
    except FormatError as e:
        layout = FORMAT_LAYOUT[fmt]
        problems.append(str(e))
    if layout not in ACCEPTED_LAYOUTS[fmt]:
        layout = FORMAT_LAYOUT[fmt]
    expected = expected_tensors(draft, layout)

    if "d2t" not in keys:
        problems.append("`d2t` missing (engines fall back to the identity map: draft id i -> "
                        "target id i, acceptance collapses)")
    if "lm_head.weight" not in keys:
        problems.append("`lm_head.weight` missing (the engine would use the verifier's "
                        "full-vocabulary head with a reduced-vocabulary drafter)")
    for key in sorted(set(expected) - keys):
        if key not in ("d2t", "lm_head.weight"):
            problems.append(f"missing key `{key}` (expected shape {list(expected[key][0])})")
    for key in sorted(keys - set(expected)):
        if not (key.startswith("model.") or key.startswith(COMPILE_PREFIX)
                or (fmt == "sglang" and _LAYER_KEY.match(key))):
            problems.append(f"unexpected key `{key}` {list(tensors[key].shape)}")
    for key in sorted(keys & set(expected)):
        shape, dtype = expected[key]
        t = tensors[key]
        if tuple(t.shape) != shape:
            problems.append(f"`{key}` has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"`{key}` has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.is_floating_point():
            problems.append(f"`{key}` has dtype {t.dtype}, expected a float dtype")
    if "d2t" in tensors and "t2d" in tensors:
        problems += _vocab_map_problems(tensors["d2t"], tensors["t2d"], draft.draft_vocab_size,
                                        draft.vocab_size)

    if problems:
        raise ExportValidationError(directory, fmt, problems)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return {
        "format": fmt,
        "layout": layout,
        "num_keys": len(keys),
        "num_parameters": int(sum(t.numel() for k, t in tensors.items()
                                  if t.is_floating_point())),
        "dtypes": dtypes,
        "shapes": {k: list(tensors[k].shape) for k in sorted(keys)},
        "aux_layer_ids_internal": list(aux_layer_ids),
        "aux_layer_ids_written": written_ids,
        "aux_convention": aux_convention(fmt, sglang_convention),
        "norm_before_residual": bool(draft.norm_before_residual),
        "checks_passed": ["config fields", "key names (no model./_orig_mod./layers.N in sglang)",
                          "exact key set", "shapes", "dtypes (d2t int64, t2d bool)",
                          "d2t offsets onto t2d", "aux ids"],
    }
