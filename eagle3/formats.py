"""Checkpoint layouts of an EAGLE-3 drafter: one record per engine format (docs/engines.md).

Each `EngineFormat` owns everything about one format: the key layout it ships, its
config.json, where its config keeps the aux-layer ids and in which convention (both
directions), whether the embedding ships, and the checks of a written directory. Adding a
format is one more record in `FORMATS`.

Key layouts: `speculators` (`layers.0.*`, vLLM's internal names and ours) and `sglang`
(`midlayer.*`, EAGLE official and SpecForge); `to_layout` maps between them (one prefix map
and its inverse), `strip_compile_prefix` drops torch.compile's `_orig_mod.`.

    write_export(out_dir, "sglang", state_dict, draft_cfg, aux_ids, ExportContext(...))
    report = validate_export(out_dir, "sglang", draft_cfg, aux_ids, ExportContext(...))

Aux ids are always given in the internal convention (HF `output_hidden_states` index) and each
format converts them. Used by stage 05, by the checkpoint writer (the speculators config of
`step-N/`) and by the base-drafter reader.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

import numpy as np
import torch

from eagle3.model import DraftModelConfig, Eagle3DraftModel
from eagle3.weights_io import TensorLike, WeightFilesError, load, open_file, write_safetensors

Layout = Literal["speculators", "sglang"]
SglangRule = Literal["auto", "post-25454", "pre-25454"]
SGLANG_VERSIONS = ("pre-25454", "post-25454")
"""SGLang before PR #25454 (adds +1 to every aux id) and after it (+1 only when the first id
is 1; v0.5.23 and later)."""

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
COMPILE_PREFIX = "_orig_mod."
SPECULATORS_VERSION = "0.9.0"
LAYER0_PREFIX: dict[Layout, str] = {"speculators": "layers.0.", "sglang": "midlayer."}
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
# Key layouts


def strip_compile_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the `_orig_mod.` prefix torch.compile puts on every parameter of a compiled model."""
    return {k.removeprefix(COMPILE_PREFIX): v for k, v in state.items()}


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


def rename_key(key: str, src: Layout, dst: Layout) -> str:
    """One key from layout `src` to layout `dst` (only layer 0 is named differently)."""
    old, new = LAYER0_PREFIX[src], LAYER0_PREFIX[dst]
    return new + key[len(old):] if key.startswith(old) else key


def to_layout(state: Mapping[str, Any], dst: Layout) -> dict[str, Any]:
    """A state dict in either layout -> layout `dst`. SGLang names only one layer (`midlayer`):
    a deeper drafter cannot be written there."""
    src = detect_layout(k for k in state if k not in ("d2t", "t2d"))
    deeper = sorted({m.group(0) for k in state if (m := _LAYER_KEY.match(k))
                     and m.group(1) != "0"})
    if dst == "sglang" and deeper:
        raise FormatError(
            f"SGLang serves one draft layer only (its extra layers drop the midlayer residual "
            f"and have no input_layernorm), but the drafter has {deeper}: train with "
            f"draft.num_layers=1 or drop `sglang` from export.formats")
    return {rename_key(k, src, dst): v for k, v in state.items()}


def expected_tensors(draft: DraftModelConfig, layout: Layout = "speculators"
                     ) -> dict[str, tuple[tuple[int, ...], Optional[torch.dtype]]]:
    """Key -> (shape, required dtype or None for any float) of a shipped drafter.

    Built from `Eagle3DraftModel` itself (on the meta device, no memory), so it can never drift
    from the model the trainer saves.
    """
    with torch.device("meta"):
        model = Eagle3DraftModel(draft)
    out = {}
    for key, tensor in model.trainable_state_dict().items():
        dtype = tensor.dtype if key in ("d2t", "t2d") else None
        out[rename_key(key, "speculators", layout)] = (tuple(tensor.shape), dtype)
    return out


def tensor_problems(expected: Mapping[str, tuple[tuple[int, ...], Optional[torch.dtype]]],
                    present: Mapping[str, Any], spell: Callable[[str], str] = str,
                    ignore_unexpected: Callable[[str], bool] = lambda k: False) -> list[str]:
    """Missing, unexpected, mis-shaped and mis-typed tensors, one line each. `present` maps
    names to tensors or to (shape, dtype) pairs; `spell` renders a key as the file spells it."""
    def shape_dtype(v: Any) -> tuple[tuple[int, ...], torch.dtype]:
        return (tuple(v.shape), v.dtype) if hasattr(v, "shape") else (tuple(v[0]), v[1])

    problems = [f"missing tensor `{spell(k)}` (expected shape {list(expected[k][0])})"
                for k in sorted(set(expected) - set(present))]
    problems += [f"unexpected tensor `{spell(k)}` {list(shape_dtype(present[k])[0])} (the "
                 f"drafter has no such weight)" for k in sorted(set(present) - set(expected))
                 if not ignore_unexpected(k)]
    for k in sorted(set(present) & set(expected)):
        (shape, dtype), (want_shape, want_dtype) = shape_dtype(present[k]), expected[k]
        if shape != want_shape:
            problems.append(f"`{spell(k)}` has shape {list(shape)}, expected {list(want_shape)}")
        elif want_dtype is not None and dtype != want_dtype:
            problems.append(f"`{spell(k)}` has dtype {dtype}, expected {want_dtype}")
        elif want_dtype is None and not dtype.is_floating_point:
            problems.append(f"`{spell(k)}` has dtype {dtype}, expected a float dtype")
    return problems


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab: int,
                       vocab: int) -> list[str]:
    """`d2t` must be offsets (target = i + d2t[i]) onto exactly the ids `t2d` marks; [] when
    the pair is valid. Wrong dtypes or ranks are reported by `tensor_problems`."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        return []
    problems: list[str] = []
    targets = torch.arange(d2t.numel()) + d2t
    in_range = bool(((targets >= 0) & (targets < vocab)).all())
    increasing = bool((targets[1:] > targets[:-1]).all()) if targets.numel() > 1 else True
    marked = in_range and t2d.numel() == vocab and bool(t2d[targets.clamp(0, vocab - 1)].all())
    if not (in_range and increasing and marked):
        hint = ""
        if (d2t.numel() and bool(((d2t >= 0) & (d2t < vocab)).all()) and t2d.numel() == vocab
                and bool(t2d[d2t].all())):
            hint = ("; d2t holds absolute target ids: store offsets d2t[i] = target_id - i "
                    "(vLLM and SGLang compute target = i + d2t[i])")
        what = ([f"i + d2t[i] leaves [0, {vocab})"] if not in_range else
                ["targets i + d2t[i] are not strictly increasing"] if not increasing else
                ["some targets i + d2t[i] are not marked in t2d"])
        problems.append(f"d2t: not valid offsets ({'; '.join(what)}){hint}")
    count = int(t2d.sum())
    if count != draft_vocab:
        problems.append(f"t2d: marks {count} target ids, draft vocabulary has {draft_vocab}")
    return problems


# ---------------------------------------------------------------------------------------------
# SGLang's aux-id conventions (docs/engines.md, "Aux-layer ids")

# Targets whose SGLang model (deepseek_v2.py, glm4_moe_lite.py in 0.5.23) adds +1 to the config
# ids only when the first id is 1 (PR #25454); every other SGLang target model (llama.py,
# qwen2.py, qwen3.py, gemma3_causal.py, ...) and every target before #25454 adds +1 always.
SGLANG_FIRST_IS_ONE_TARGETS = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration", "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM"})


def sglang_captured(written: list[int], target_arch: str, version: str) -> list[int]:
    """HF `output_hidden_states` indices SGLang `version` captures from a `target_arch`
    verifier for config ids `written` (id i = the input of decoder layer i)."""
    first_is_one = target_arch in SGLANG_FIRST_IS_ONE_TARGETS and version == "post-25454"
    if first_is_one and not (written and written[0] == 1):
        return list(written)
    return [i + 1 for i in written]


def sglang_written(internal: list[int], rule: SglangRule,
                   target_arch: str) -> tuple[list[int], list[str]]:
    """(ids to write, SGLang versions on which they capture `internal`) under `rule`.

    The candidates are the ids as they are and minus one. `auto` takes the one valid on the
    most SGLang versions, then the one valid on current SGLang: ids minus one for every target
    that adds +1 (Llama, Qwen, ...), and for DeepSeek/Kimi targets when the first id is 2 (e.g.
    [2,30,58] as [1,29,57]: old SGLang always adds +1, new SGLang because the first id is 1).
    A version rule writes what that version needs."""
    def valid(written: list[int]) -> list[str]:
        return [v for v in SGLANG_VERSIONS if min(written) >= 0
                and sglang_captured(written, target_arch, v) == list(internal)]

    needed = "post-25454" if rule == "auto" else rule  # auto must serve on current SGLang
    options = [(w, valid(w)) for w in ([i - 1 for i in internal], list(internal))
               if needed in valid(w)]
    if not options:
        raise FormatError(
            f"no {rule} SGLang config captures aux ids {list(internal)} of a {target_arch} "
            f"verifier (SGLang shifts ids that start at 1): capture from layer >= 2, or set "
            f"export.sglang_aux_ids=pre-25454 for an older SGLang")
    return max(options, key=lambda o: (len(o[1]), "post-25454" in o[1]))


# ---------------------------------------------------------------------------------------------
# Config fields shared by the formats


def _rope_fields(draft: DraftModelConfig) -> dict[str, Any]:
    """The rope base and scaling, as `rope_theta` / `rope_scaling` (transformers 4, older engine
    code) and in `rope_parameters` (transformers 5, which vLLM and SGLang 0.5.23 read first):
    the same values in both."""
    theta = float(draft.rope_theta)
    if not draft.rope_scaling:
        return {"rope_theta": theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": dict(draft.rope_scaling),
            "rope_parameters": {**{k: v for k, v in draft.rope_scaling.items() if k != "type"},
                                "rope_type": "yarn", "rope_theta": theta}}


def _llama_fields(draft: DraftModelConfig) -> dict[str, Any]:
    """Plain Llama fields of the draft layer, readable by transformers 4 and 5 (an MLA layer's:
    `_deepseek_fields`)."""
    if draft.attention == "mla":
        return _deepseek_fields(draft)
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
        **_rope_fields(draft),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": draft.vocab_size,
    }


MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
SPECULATORS_HAS_NO_MLA = ("speculators 0.9 has no MLA draft layer (its Eagle3DraftModel is "
                          "Llama attention): drop speculators from export.formats")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


# The model_type of an MLA drafter's config: both engines read "kimi_k2" as DeepSeek-V3's config
# class, as lightseekorg's published MLA drafters write it; "deepseek_v3" would make vLLM take
# the drafter for DeepSeek's MTP module ("Eagle3DeepSeekMTPModel ... not supported":
# docs/engines.md "MLA draft layer").
MLA_MODEL_TYPE = "kimi_k2"
# model_types transformers does not know and both engines register as a transformers class
# (vLLM: transformers_utils/config.py, SGLang: utils/hf_transformers/common.py)
ENGINE_CONFIG_ALIASES = {MLA_MODEL_TYPE: "DeepseekV3Config"}


def _deepseek_fields(draft: DraftModelConfig) -> dict[str, Any]:
    """The DeepSeek-V3 fields of an MLA draft layer, as vLLM's and SGLang's
    `Eagle3DeepseekV2ForCausalLM` read them (docs/engines.md "MLA draft layer"): the MLA
    dimensions, and the YaRN scaling both as `rope_scaling` (older readers) and in
    `rope_parameters` (transformers 5, which vLLM and SGLang 0.5.23 read)."""
    return {
        "model_type": MLA_MODEL_TYPE,
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_hidden_layers": draft.num_layers,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_attention_heads,
        **{k: getattr(draft, k) for k in MLA_FIELDS},
        "hidden_act": "silu",
        "rms_norm_eps": draft.rms_norm_eps,
        "max_position_embeddings": draft.max_position_embeddings,
        **_rope_fields(draft),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": draft.vocab_size,
    }


def _eagle_fields(draft: DraftModelConfig) -> dict[str, Any]:
    # Written explicitly: vLLM's speculators path defaults norm_before_residual to True, the
    # Llama path to False. The EAGLE-3.1 flags are top-level fields in all three engines'
    # readers (docs/engines.md "EAGLE-3.1 norms"); norm_before_fc is not in our model.
    return {
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": draft.target_hidden_size,
        "norm_before_residual": bool(draft.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": bool(draft.fc_norm),
        "norm_output": bool(draft.norm_output),
    }


def _check_aux(draft: DraftModelConfig, ids: list[int]) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != draft.num_aux:
        raise FormatError(f"{len(ids)} aux layer ids {ids} but the drafter's fc takes "
                          f"num_aux={draft.num_aux} states")
    if ids != sorted(set(ids)):
        raise FormatError(f"aux layer ids {ids} must be distinct and ascending (engines "
                          f"concatenate aux states in layer order)")
    return ids


def _shape_problems(cfg: dict[str, Any], layer: dict[str, Any],
                    draft: DraftModelConfig) -> list[str]:
    """Config fields that must equal the drafter the weights came from."""
    problems = []
    want = {"draft_vocab_size": (cfg, draft.draft_vocab_size),
            "target_hidden_size": (cfg, draft.target_hidden_size),
            "vocab_size": (layer, draft.vocab_size), "hidden_size": (layer, draft.hidden_size),
            "intermediate_size": (layer, draft.intermediate_size),
            "num_hidden_layers": (layer, draft.num_layers),
            "num_attention_heads": (layer, draft.num_attention_heads),
            "num_key_value_heads": (layer, draft.num_key_value_heads)}
    if draft.attention == "mla":
        want.update({k: (layer, getattr(draft, k)) for k in MLA_FIELDS})
    else:
        want["head_dim"] = (layer, draft.head_dim)
    if (layer.get("rope_scaling") or None) != draft.rope_scaling:
        problems.append(f"config: rope_scaling {layer.get('rope_scaling')}, the drafter was "
                        f"trained with {draft.rope_scaling}")
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
    if "norm_before_residual" not in cfg:
        problems.append("config: `norm_before_residual` absent (vLLM's speculators path "
                        "defaults it to true, its Llama path to false): write it explicitly")
    elif cfg["norm_before_residual"] is not bool(draft.norm_before_residual):
        problems.append(f"config: norm_before_residual={cfg['norm_before_residual']} but the "
                        f"drafter was trained with {draft.norm_before_residual}")
    if cfg.get("norm_before_fc"):
        problems.append("config: `norm_before_fc` is true; this drafter has no such norm")
    for flag in ("fc_norm", "norm_output"):  # an engine reading false skips a trained norm
        if bool(cfg.get(flag)) is not bool(getattr(draft, flag)):
            problems.append(f"config: `{flag}` is {cfg.get(flag)}, the drafter was trained "
                            f"with {getattr(draft, flag)}")
    return problems


@dataclass(frozen=True)
class ExportContext:
    """What a format's config needs besides the drafter itself."""
    verifier_path: str
    """Absolute verifier path (or hub id): what `vllm serve DIR` starts for a speculators
    config."""
    verifier_arch: str
    speculative_tokens: int = 3
    sglang_rule: SglangRule = "auto"


# ---------------------------------------------------------------------------------------------
# The formats


@dataclass(frozen=True)
class EngineFormat:
    """One export format. Each subclass defines `config(draft, internal_ids, ctx)` (the
    config.json it ships) and overrides where its aux ids live and how they convert."""
    name: str
    layout: Layout
    """Key layout shipped."""
    accepted_layouts: tuple[Layout, ...]
    """Key layouts the engine loads (a hand-made directory in another one still validates)."""
    architecture: str
    """The `architectures` entry of a Llama (MHA) draft layer."""
    ships_embedding: bool = False
    """No format ships `embed_tokens`: SGLang always replaces it with the verifier's, and vLLM
    shares the verifier's when the checkpoint has none, so either engine serves with exactly
    the embedding the drafter trained with (the verifier's, frozen); a shipped copy could only
    be a stale or foreign one (TorchSpec#38)."""

    def architecture_of(self, draft: DraftModelConfig) -> str:
        """The engine class that builds `draft`: an MLA layer is `Eagle3DeepseekV2ForCausalLM`
        in vLLM and SGLang (docs/engines.md "MLA draft layer")."""
        return MLA_ARCHITECTURE if draft.attention == "mla" else self.architecture

    def written_aux_ids(self, internal: list[int], ctx: ExportContext) -> list[int]:
        return list(internal)

    def valid_for(self, internal: list[int], ctx: ExportContext) -> list[str]:
        """Engine versions on which the written ids capture exactly `internal`."""
        return ["all"]

    def internal_aux_ids(self, written: list[int], target_arch: str = "",
                         engine_version: str = "") -> list[int]:
        """What the engine captures from a `target_arch` verifier for `written` ids (HF
        indices); the inverse of `written_aux_ids`."""
        return list(written)

    def aux_ids_in(self, cfg: dict[str, Any]) -> tuple[Optional[list[int]], str]:
        """(ids as the engine reads them from `cfg`, where)."""
        key = "eagle_aux_hidden_state_layer_ids"
        return cfg.get(key), key

    def config_problems(self, cfg: dict[str, Any], draft: DraftModelConfig,
                        internal: list[int], ctx: ExportContext) -> list[str]:
        problems = []
        if cfg.get("architectures") != [self.architecture_of(draft)]:
            problems.append(f"config: `architectures` is {cfg.get('architectures')!r}, must be "
                            f"{[self.architecture_of(draft)]}")
        ids, where = self.aux_ids_in(cfg)
        written = self.written_aux_ids(internal, ctx)
        if not ids:
            problems.append(f"config: aux ids `{where}` absent (engines fall back to default "
                            f"layers silently)")
        elif list(ids) != written:
            problems.append(f"config: `{where}` is {ids}, expected {written}")
        if cfg.get("tie_word_embeddings") is not False:
            problems.append("config: `tie_word_embeddings` must be false (true makes the "
                            "engine use the embedding as lm_head)")
        return problems + _shape_problems(cfg, self._layer(cfg), draft)

    def _layer(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return cfg


@dataclass(frozen=True)
class VllmFormat(EngineFormat):
    """vLLM's `Eagle3LlamaForCausalLM`, launched with --speculative-config. Ids are vLLM's
    "capture before layer j" = the internal convention, written top-level (the only place
    vLLM's V2 model runner reads) and in `eagle_config` (sizes `fc` in some versions)."""

    def config(self, draft: DraftModelConfig, internal: list[int],
               ctx: ExportContext) -> dict[str, Any]:
        ids = _check_aux(draft, internal)
        return {"architectures": [self.architecture_of(draft)], **_llama_fields(draft),
                **_eagle_fields(draft), "eagle_aux_hidden_state_layer_ids": ids,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids,
                                 "use_aux_hidden_state": True}}

    def config_problems(self, cfg: dict[str, Any], draft: DraftModelConfig,
                        internal: list[int], ctx: ExportContext) -> list[str]:
        problems = super().config_problems(cfg, draft, internal, ctx)
        nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = cfg.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and nested != top:
            problems.append(f"config: eagle_config ids {nested} differ from top-level ids {top}")
        return problems


@dataclass(frozen=True)
class SglangFormat(EngineFormat):
    """SGLang's `LlamaForCausalLMEagle3` (`midlayer.*`; SGLang >= 0.5.23 also maps it to
    `layers.0.*`, older SGLang knows only `midlayer`). Aux ids only in `eagle_config`, in
    SGLang's convention for the verifier's architecture (`sglang_written`); no top-level list,
    so that no other reader takes SGLang-convention ids at face value. One layer, three aux
    states, and no norm_before_residual variant."""

    def written_aux_ids(self, internal: list[int], ctx: ExportContext) -> list[int]:
        return sglang_written(list(internal), ctx.sglang_rule, ctx.verifier_arch)[0]

    def valid_for(self, internal: list[int], ctx: ExportContext) -> list[str]:
        written = sglang_written(list(internal), ctx.sglang_rule, ctx.verifier_arch)
        return [f"sglang {v}" for v in written[1]]

    def internal_aux_ids(self, written: list[int], target_arch: str = "",
                         engine_version: str = "post-25454") -> list[int]:
        return sglang_captured(list(written), target_arch, engine_version)

    def aux_ids_in(self, cfg: dict[str, Any]) -> tuple[Optional[list[int]], str]:
        return ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                "eagle_config.eagle_aux_hidden_state_layer_ids")

    def config(self, draft: DraftModelConfig, internal: list[int],
               ctx: ExportContext) -> dict[str, Any]:
        ids = _check_aux(draft, internal)
        if draft.num_layers != 1:
            raise FormatError(f"SGLang serves one draft layer only, the drafter has "
                              f"{draft.num_layers}: train with draft.num_layers=1 or drop "
                              f"sglang from export.formats")
        if draft.num_aux != 3:
            raise FormatError(f"SGLang's fc is fixed at 3 aux states, the drafter has "
                              f"num_aux={draft.num_aux}")
        if draft.norm_before_residual:
            raise FormatError("SGLang has no norm_before_residual=true variant: train with "
                              "draft.norm_before_residual=false or drop sglang from "
                              "export.formats")
        if draft.attention == "mla" and not draft.q_lora_rank:
            raise FormatError("SGLang's MLA draft layer needs a query down-projection "
                              "(q_lora_rank): train with draft.q_lora_rank set or drop sglang "
                              "from export.formats")
        return {"architectures": [self.architecture_of(draft)], **_llama_fields(draft),
                **_eagle_fields(draft),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                 self.written_aux_ids(ids, ctx), "use_aux_hidden_state": True}}

    def config_problems(self, cfg: dict[str, Any], draft: DraftModelConfig,
                        internal: list[int], ctx: ExportContext) -> list[str]:
        problems = super().config_problems(cfg, draft, internal, ctx)
        if "eagle_aux_hidden_state_layer_ids" in cfg:
            problems.append("config: top-level eagle_aux_hidden_state_layer_ids in an SGLang "
                            "export (SGLang ignores it; other readers would take SGLang-"
                            "convention ids at face value)")
        if cfg.get("norm_before_residual") is True:
            problems.append("config: SGLang cannot serve norm_before_residual=true")
        return problems


@dataclass(frozen=True)
class SpeculatorsFormat(EngineFormat):
    """speculators 0.9 (`layers.0.*`, nested `transformer_layer_config`); `vllm serve DIR`
    starts the verifier named in `speculators_config.verifier.name_or_path`."""

    def _layer(self, cfg: dict[str, Any]) -> dict[str, Any]:
        layer = cfg.get("transformer_layer_config")
        return layer if isinstance(layer, dict) else {}

    def config(self, draft: DraftModelConfig, internal: list[int],
               ctx: ExportContext) -> dict[str, Any]:
        ids = _check_aux(draft, internal)
        if draft.attention == "mla":
            raise FormatError(SPECULATORS_HAS_NO_MLA)
        return {
            "architectures": [self.architecture],
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
                                      "speculative_tokens": int(ctx.speculative_tokens),
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": str(ctx.verifier_path),
                             "architectures": [ctx.verifier_arch]},
            },
        }

    def config_problems(self, cfg: dict[str, Any], draft: DraftModelConfig,
                        internal: list[int], ctx: ExportContext) -> list[str]:
        problems = super().config_problems(cfg, draft, internal, ctx)
        if not isinstance(cfg.get("transformer_layer_config"), dict):
            problems.append("config: `transformer_layer_config` missing (vLLM refuses a "
                            "speculators config without it)")
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
        return problems


FORMATS: dict[str, EngineFormat] = {
    "vllm": VllmFormat("vllm", "speculators", ("speculators", "sglang"), "LlamaForCausalLMEagle3"),
    "sglang": SglangFormat("sglang", "sglang", ("sglang",), "LlamaForCausalLMEagle3"),
    "speculators": SpeculatorsFormat("speculators", "speculators", ("speculators",),
                                     "Eagle3DraftModel"),
}


def get_format(name: str) -> EngineFormat:
    if name not in FORMATS:
        raise FormatError(f"unknown export format {name!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def speculators_config(draft: DraftModelConfig, aux_layer_ids: list[int],
                       ctx: ExportContext) -> dict[str, Any]:
    """config.json of a training checkpoint (`step-N/`): the speculators layout, or for an MLA
    layer (which speculators does not have) vLLM's flat `Eagle3DeepseekV2ForCausalLM` one; the
    keys are `layers.N.*` either way, and both read back as a base drafter."""
    fmt = "vllm" if draft.attention == "mla" else "speculators"
    return FORMATS[fmt].config(draft, aux_layer_ids, ctx)


# ---------------------------------------------------------------------------------------------
# Writing


def clean_floats(obj: Any) -> Any:
    """Floats that are float32 values (e.g. an eps read from a GGUF, 9.999999747378752e-06)
    written as the shortest float32 literal (1e-05), so configs read as users wrote them."""
    if isinstance(obj, dict):
        return {k: clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_floats(v) for v in obj]
    if isinstance(obj, float) and np.isfinite(obj) and float(np.float32(obj)) == obj:
        return float(repr(np.float32(obj)).removeprefix("np.float32(").removesuffix(")"))
    return obj


def export_state_dict(state: Mapping[str, TensorLike], fmt: str) -> dict[str, TensorLike]:
    """A training state dict (any layout, maybe compiled) -> the keys `fmt` ships."""
    spec = get_format(fmt)
    state = strip_compile_prefix(state)
    if not spec.ships_embedding:
        state = {k: v for k, v in state.items() if not k.startswith("embed_tokens.")}
    return to_layout(state, spec.layout)


def write_export(directory: Path, fmt: str, state: Mapping[str, TensorLike],
                 draft: DraftModelConfig, aux_layer_ids: list[int], ctx: ExportContext,
                 dtype: Optional[str] = None) -> None:
    """Write config.json + model.safetensors of `fmt` into an existing (temporary) directory.

    `state` values may be lazy (`eagle3.weights_io.LazyTensor`): each is read, cast and
    written in turn. `dtype` (e.g. "bfloat16") casts the float weights; d2t/t2d keep
    int64/bool.
    """
    config = get_format(fmt).config(draft, aux_layer_ids, ctx)
    tensors = export_state_dict(state, fmt)
    cast = {k: getattr(torch, dtype) for k, v in tensors.items()
            if dtype is not None and v.is_floating_point()}
    floats = {str(cast.get(k, v.dtype)).removeprefix("torch.") for k, v in tensors.items()
              if v.is_floating_point()}
    if len(floats) == 1:
        config["dtype"] = floats.pop()
    # One tensor in memory at a time (a Kimi-size drafter is 5 GB): weights_io streams it.
    write_safetensors(directory / WEIGHTS_FILE, tensors, cast, {"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(clean_floats(config), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Validation (reads back what the engine will load)


def _key_problems(fmt: str, keys: set[str], draft: DraftModelConfig) -> list[str]:
    """Key-name hazards: each one makes an engine fail or load random weights silently."""
    problems = []
    for key in sorted(keys):
        if key.startswith("model."):
            problems.append(f"key `{key}` starts with `model.` (vLLM prefixes model. itself and "
                            f"fails; strip it)")
        if key.startswith(COMPILE_PREFIX):
            problems.append(f"key `{key}` carries torch.compile's `_orig_mod.` prefix")
    layer_keys = sorted(k for k in keys if _LAYER_KEY.match(k))
    if fmt == "sglang" and layer_keys:
        problems.append(f"SGLang export has `layers.N.*` keys {layer_keys[:3]}"
                        f"{'...' if len(layer_keys) > 3 else ''}: SGLang before 0.5.23 drops "
                        f"them silently (random weights); rename to `midlayer.*`")
    maps = sorted(keys & {"d2t", "t2d"})
    if draft.full_vocab and maps:
        problems.append(f"{' and '.join(f'`{k}`' for k in maps)} shipped with a full-vocabulary "
                        f"head: vLLM has no parameter to load `d2t` into and refuses the "
                        f"drafter; SGLang takes the hot-token path; ship neither "
                        f"(docs/engines.md \"Full vocabulary\")")
    if not draft.full_vocab and "d2t" not in keys:
        problems.append("`d2t` missing (engines fall back to the identity map: draft id i -> "
                        "target id i, acceptance collapses)")
    if "lm_head.weight" not in keys:
        problems.append("`lm_head.weight` missing (the engine would use the verifier's "
                        "full-vocabulary head in place of the drafter's trained one)")
    return problems


def _read_config(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.is_file():
        problems.append(f"{CONFIG_FILE} missing")
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{CONFIG_FILE} is not valid JSON ({e})")
        return {}
    return cfg if isinstance(cfg, dict) else {}


def parsed_config_problems(directory: Path, cfg: dict[str, Any], fmt: str,
                           draft: DraftModelConfig) -> list[str]:
    """The draft layer's config as the engines parse it: through transformers' `AutoConfig`
    (vLLM's and SGLang's config loaders; for the speculators format, its
    `transformer_layer_config` through `LlamaConfig`, as speculators builds it). A field the
    JSON holds but transformers drops or renames (transformers 5 folds `rope_theta` into
    `rope_parameters`) would be served at the engine's default without a word; here it is a
    problem. The rope base is read the way SGLang's and vLLM's Llama code read it:
    `rope_parameters["rope_theta"]` when the parsed config has `rope_parameters`, else
    `rope_theta` (docs/engines.md, "Config fields as transformers parses them")."""
    import transformers

    try:
        if fmt == "speculators":
            parsed = transformers.LlamaConfig(**cfg.get("transformer_layer_config", {}))
        elif cfg.get("model_type") in ENGINE_CONFIG_ALIASES:  # registered by the engines
            alias = getattr(transformers, ENGINE_CONFIG_ALIASES[cfg["model_type"]])
            parsed = alias.from_dict({k: v for k, v in cfg.items() if k != "model_type"})
        else:
            parsed = transformers.AutoConfig.from_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return [f"config: transformers {transformers.__version__} cannot parse it "
                f"({type(e).__name__}: {first[:200]})"]
    rope = getattr(parsed, "rope_parameters", None)
    rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else \
        getattr(parsed, "rope_theta", None)
    want = {"hidden_size": draft.hidden_size, "intermediate_size": draft.intermediate_size,
            "num_hidden_layers": draft.num_layers,
            "num_attention_heads": draft.num_attention_heads,
            "num_key_value_heads": draft.num_key_value_heads,
            "rms_norm_eps": draft.rms_norm_eps, "vocab_size": draft.vocab_size,
            "max_position_embeddings": draft.max_position_embeddings}
    if draft.attention == "mla":
        want.update({k: getattr(draft, k) for k in MLA_FIELDS})
    else:
        want["head_dim"] = draft.head_dim
    got = {k: getattr(parsed, k, None) for k in want}
    if fmt != "speculators":  # speculators keeps it beside the layer config, not in it
        want["draft_vocab_size"] = draft.draft_vocab_size
        got["draft_vocab_size"] = getattr(parsed, "draft_vocab_size", None)
    want["rope theta"], got["rope theta"] = float(draft.rope_theta), rope_theta
    # plain RoPE, or an MLA layer's YaRN: any other scaling the engine would apply alone
    want["rope type"] = "yarn" if draft.rope_scaling else "default"
    got["rope type"] = (rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else
                        (getattr(parsed, "rope_scaling", None) or {}).get("rope_type",
                                                                          "default"))
    for k, v in (draft.rope_scaling or {}).items():
        if k != "type":
            want[f"rope {k}"] = v
            got[f"rope {k}"] = rope.get(k) if isinstance(rope, dict) else None
    def same(a: Any, b: Any) -> bool:  # floats are written cleaned of float32 noise
        return a == b or (isinstance(a, float) and isinstance(b, float)
                          and math.isclose(a, b, rel_tol=1e-6))
    return [f"config: transformers {transformers.__version__} parses `{k}` as {got[k]!r}, "
            f"the drafter has {v!r}" for k, v in want.items() if not same(got[k], v)]


def validate_export(directory: Path, fmt: str, draft: DraftModelConfig,
                    aux_layer_ids: list[int], ctx: ExportContext) -> dict[str, Any]:
    """Check an exported directory as its engine will read it; return a summary for reports.

    `draft` and `aux_layer_ids` (internal convention) describe the drafter that was exported;
    raises ExportValidationError listing every problem found.
    """
    spec = get_format(fmt)
    directory = Path(directory)
    problems: list[str] = []
    cfg = _read_config(directory / CONFIG_FILE, problems)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ExportValidationError(directory, fmt, problems + [f"{WEIGHTS_FILE} missing"])
    try:
        tensors = open_file(weights_path)  # headers only; each tensor is read once below
    except WeightFilesError as e:
        raise ExportValidationError(directory, fmt, problems + e.problems) from None
    keys = set(tensors)
    if cfg:
        problems += spec.config_problems(cfg, draft, aux_layer_ids, ctx)
        problems += parsed_config_problems(directory, cfg, fmt, draft)
    problems += _key_problems(fmt, keys, draft)
    try:
        layout = detect_layout(k.removeprefix("model.").removeprefix(COMPILE_PREFIX)
                               for k in keys if k not in ("d2t", "t2d"))
    except FormatError as e:
        layout = spec.layout
        problems.append(str(e))
    if layout not in spec.accepted_layouts:
        layout = spec.layout
    def hazard(k: str) -> bool:  # already reported by _key_problems
        return k.startswith(("model.", COMPILE_PREFIX)) or (fmt == "sglang" and bool(
            _LAYER_KEY.match(k))) or (draft.full_vocab and k in ("d2t", "t2d"))
    expected = {k: v for k, v in expected_tensors(draft, layout).items()
                if k not in ("d2t", "lm_head.weight") or k in keys}  # reported above
    problems += tensor_problems(expected, tensors, ignore_unexpected=hazard)
    nonfinite = [k for k, t in sorted(tensors.items()) if t.is_floating_point()
                 and not bool(torch.isfinite(load(t)).all())]
    problems += [f"`{k}` has NaN or infinite values" for k in nonfinite]
    if "d2t" in tensors and "t2d" in tensors and not draft.full_vocab:
        problems += vocab_map_problems(load(tensors["d2t"]), load(tensors["t2d"]),
                                       draft.draft_vocab_size, draft.vocab_size)
    if problems:
        raise ExportValidationError(directory, fmt, problems)
    return _summary(fmt, layout, tensors, draft, aux_layer_ids, ctx)


def _summary(fmt: str, layout: str, tensors: dict[str, TensorLike], draft: DraftModelConfig,
             aux_layer_ids: list[int], ctx: ExportContext) -> dict[str, Any]:
    spec = get_format(fmt)
    return {
        "format": fmt,
        "layout": layout,
        "num_keys": len(tensors),
        "num_parameters": int(sum(t.numel() for t in tensors.values() if t.is_floating_point())),
        "vocab_size": draft.vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "full_vocab": draft.full_vocab,
        "attention": draft.attention,
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
        "shapes": {k: list(tensors[k].shape) for k in sorted(tensors)},
        "aux_layer_ids_internal": list(aux_layer_ids),
        "aux_layer_ids_written": spec.written_aux_ids(list(aux_layer_ids), ctx),
        "aux_ids_valid_for": spec.valid_for(list(aux_layer_ids), ctx),
        "norm_before_residual": bool(draft.norm_before_residual),
        "fc_norm": bool(draft.fc_norm),
        "norm_output": bool(draft.norm_output),
        "embedding_shipped": spec.ships_embedding,
        "checks_passed": ["config fields", "key names (no model./_orig_mod./layers.N in sglang)",
                          "exact key set", "shapes", "dtypes (d2t int64, t2d bool)",
                          "finite weights", "full vocabulary: no d2t/t2d" if draft.full_vocab
                          else "d2t offsets onto t2d", "aux ids"],
    }
