"""Base drafters for `--finetune-from` (and any drafter directory stage 05 converts): read a
published EAGLE-3 drafter in any layout we know into our internal names, and check it against
the drafter we would build.

Layouts: SGLang/EAGLE/SpecForge/AQ-MedAI (`midlayer.*`, flat `LlamaForCausalLMEagle3` config,
aux ids in `eagle_config`), speculators (`layers.N.*`, nested `transformer_layer_config`,
top-level aux ids) and vLLM-style (flat config, `layers.N.*`); weights in model.safetensors, a
sharded model.safetensors.index.json, or a pytorch_model.bin read with `weights_only`.
Prefixes that are only packaging (torch.compile's `_orig_mod.`, a wrapper's `model.`) are
stripped. A tensor with NaN or infinite values is refused at load. `check_base` lists every
missing, unexpected or mis-shaped tensor, a foreign embedding and a different vocabulary map in
one error; `verifier_fit_problems`, shared with `05_fix_keys.py --from`, says whether a drafter
can serve a verifier of a given width and vocabulary at all.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.formats import (COMPILE_PREFIX, FORMATS, FormatError, detect_layout,
                            expected_tensors, rename_key, tensor_problems, to_layout,
                            vocab_map_problems)
from eagle3.model import YARN_KEYS, DraftModelConfig
from eagle3.runs import StageError
from eagle3.weights_io import (LazyTensor, TensorLike, WeightFilesError, all_finite,
                               load as load_tensor, max_abs_difference, open_weights)


class BaseDrafterError(StageError):
    """A base drafter that cannot be fine-tuned as is; `problems` lists every issue found."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = path
        self.problems = problems
        if len(problems) == 1:  # one line, as every user error of a stage
            super().__init__(f"base drafter {path} is unusable: {problems[0]}")
            return
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"base drafter {path} is unusable ({len(problems)} problem(s)):\n"
                         f"{lines}")


@dataclass
class BaseDrafter:
    """A pretrained drafter as read from disk: weights under our names plus its shape facts.

    `weights` holds everything but the vocabulary maps and the embedding (`fc.weight`,
    `layers.N.*`, `norm.weight`, `lm_head.weight`, and anything unexpected, kept so that
    `check_base` can name it), unread until used (`eagle3.weights_io`). Shape facts come from
    its config.json; where that is silent they are read off the tensor headers.
    """
    path: Path
    layout: str
    """`sglang` (midlayer.*, flat LlamaForCausalLMEagle3 config), `speculators` (nested
    transformer_layer_config) or `vllm` (flat config, layers.N.* keys)."""
    weights: dict[str, TensorLike]
    d2t: Optional[torch.Tensor]
    t2d: Optional[torch.Tensor]
    embed: Optional[TensorLike]
    """`embed_tokens.weight` when the base ships one (it must equal the verifier's)."""
    shape: DraftModelConfig
    """Our model config with exactly the base's shape and numerics."""
    aux_layer_ids: Optional[list[int]]
    """As written in the base's config, in its engine's convention (see `aux_ids_internal`)."""
    unsupported_flags: list[str] = field(default_factory=list)
    """EAGLE-3.1 / speculators options set in the config that our model does not have."""

    def aux_ids_internal(self, target_arch: str,
                         engine_version: str = "post-25454") -> Optional[list[int]]:
        """The aux ids as HF `output_hidden_states` indices, as the engine of the base's own
        layout captures them from a `target_arch` verifier (SGLang's depend on the target model
        and on the SGLang version; docs/engines.md)."""
        if self.aux_layer_ids is None:
            return None
        fmt = FORMATS["sglang" if self.layout == "sglang" else "vllm"]
        return fmt.internal_aux_ids(self.aux_layer_ids, target_arch, engine_version)


def _read_weights(path: Path) -> dict[str, TensorLike]:
    """The tensors of a single-file or sharded checkpoint under their plain names (packaging
    prefixes dropped); lazy: nothing is read until used."""
    try:
        return normalize_keys(open_weights(path))
    except WeightFilesError as e:
        raise BaseDrafterError(path, e.problems) from None
    except FormatError as e:
        raise BaseDrafterError(path, [str(e)]) from None


PACKAGING_PREFIXES = (COMPILE_PREFIX, "model.")
"""torch.compile's `_orig_mod.`, and `model.` of a wrapper: on every key, or, as an HF
`...ForCausalLM` saves it, on the body (`model.fc.weight`, `model.layers.0.*`) with `lm_head`,
`d2t` and `t2d` at top level. No drafter tensor of any layout starts with either."""


def _plain(key: str) -> str:
    """`key` without packaging prefixes, nested in either order (`_orig_mod.model.fc.weight`)."""
    while key.startswith(PACKAGING_PREFIXES):
        key = next(key.removeprefix(p) for p in PACKAGING_PREFIXES if key.startswith(p))
    return key


def normalize_keys(tensors: dict[str, TensorLike]) -> dict[str, TensorLike]:
    """Drop packaging prefixes from every key that carries them. Unambiguous because no drafter
    tensor starts with one, unless both spellings of a tensor are present: that is refused."""
    out: dict[str, TensorLike] = {}
    spelled: dict[str, str] = {}
    for key, t in tensors.items():
        plain = _plain(key)
        if plain in out:
            first, second = sorted((spelled[plain], key))
            raise FormatError(f"`{first}` and `{second}` are the same tensor `{plain}` under "
                              f"packaging prefixes ({', '.join(PACKAGING_PREFIXES)}): keep one")
        out[plain], spelled[plain] = t, key
    return out


def _has_nested_config(cfg: dict[str, Any]) -> bool:
    return isinstance(cfg.get("transformer_layer_config"), dict) or "speculators_model_type" in cfg


def _rope_theta(layer: dict[str, Any]) -> Optional[float]:
    params = layer.get("rope_parameters") or {}
    theta = layer.get("rope_theta", params.get("rope_theta"))
    return None if theta is None else float(theta)


LEGACY_FC_NORM = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                  "aux_norm_high": "fc_norm.2"}
"""Older SGLang-trained EAGLE-3.1 drafters name the per-aux norms so (SGLang 0.5.23
`llama_eagle3.py` `legacy_name_map`, with the `use_aux_norm` flag)."""


def _fc_norm_name(key: str) -> str:
    head, _, rest = key.partition(".")
    return f"{LEGACY_FC_NORM[head]}.{rest}" if head in LEGACY_FC_NORM else key


def _unsupported(cfg: dict[str, Any], layer: dict[str, Any]) -> list[str]:
    """Options of the base our model does not implement (its weights would compute otherwise)."""
    out = [f"`{flag}` is true (a single norm over the concatenated aux states, which our "
           f"drafter does not have; EAGLE-3.1's per-aux `fc_norm` it has)"
           for flag in ("norm_before_fc",) if cfg.get(flag)]
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"`hidden_act` is {act!r}; our drafter's MLP is SiLU-gated")
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            out.append(f"`{flag}` is true; our drafter has no biases")
    scaling = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    yarn = kind == "yarn" or (_is_mla(layer) and kind == "deepseek_yarn")
    if kind not in ("default", None) and not yarn:
        out.append(f"rope scaling {kind!r}; our drafter uses plain RoPE or YaRN")
    elif yarn and not _is_mla(layer):  # the keys `yarn_of` would not carry over
        ignored = sorted(set(scaling) - set(YARN_KEYS) - {"rope_theta"})
        if ignored:
            out.append(f"rope scaling yarn with {ignored}, which our Llama layer's YaRN does "
                       f"not implement")
    return out


def _is_mla(layer: dict[str, Any]) -> bool:
    """An MLA draft layer (lightseek's `Eagle3DeepseekV2ForCausalLM`): its config has the
    latent width, as DeepSeek-V3's does."""
    return layer.get("kv_lora_rank") is not None


def _yarn(layer: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The layer's YaRN rope scaling in `rope_scaling`'s form, or None (any other scaling is
    reported by `_unsupported`)."""
    from eagle3.config import ConfigError, yarn_of
    try:
        return yarn_of(layer)
    except ConfigError:
        return None


def _mla_shape(layer: dict[str, Any]) -> dict[str, Any]:
    """The MLA fields of our model config from a DeepSeek-style draft config."""
    scaling = _yarn(layer)
    return {"attention": "mla", "q_lora_rank": layer.get("q_lora_rank"),
            **{k: int(layer.get(k) or 0) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                   "qk_rope_head_dim", "v_head_dim")},
            "rope_scaling": scaling}


def load(path: str | Path) -> BaseDrafter:
    """Read a pretrained EAGLE-3 drafter directory in any of the layouts we know.

    SGLang/EAGLE (`midlayer.*`, flat `LlamaForCausalLMEagle3` config, aux ids in
    `eagle_config`), speculators (`layers.N.*`, nested `transformer_layer_config`, top-level
    aux ids; `norm_before_residual` defaults to true there, as in speculators and vLLM) and
    vLLM-style (flat config, `layers.N.*`); weights in model.safetensors, a sharded
    model.safetensors.index.json, or pytorch_model.bin. Keys are mapped to our names through
    `eagle3.formats`, packaging prefixes (`_orig_mod.`, `model.`) dropped. Refused here: files
    that disagree with their index (`weights_io.weight_map`) and non-finite weights. Nothing is
    checked against our config here: that is `check_base`.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise BaseDrafterError(path, ["not a directory (give the drafter's checkpoint folder)"])
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BaseDrafterError(path, ["config.json missing (the draft shape cannot be known)"])
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise BaseDrafterError(path, [f"config.json is not valid JSON ({e})"]) from None
    tensors = _read_weights(path)
    try:
        key_layout = detect_layout(k for k in tensors if k not in ("d2t", "t2d"))
    except FormatError as e:
        raise BaseDrafterError(path, [str(e)]) from None
    weights = {_fc_norm_name(k): t for k, t in to_layout(tensors, "speculators").items()}
    d2t, t2d = (None if weights.get(k) is None else load_tensor(weights.pop(k))
                for k in ("d2t", "t2d"))
    embed = weights.pop("embed_tokens.weight", None)

    nested = _has_nested_config(cfg)
    layout = "speculators" if nested else ("sglang" if key_layout == "sglang" else "vllm")
    layer = cfg["transformer_layer_config"] if nested else cfg
    eagle = cfg.get("eagle_config") or {}
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None or layout == "sglang":  # SGLang reads only eagle_config
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", aux)

    missing = [k for k in ("hidden_size", "num_attention_heads") if k not in layer]
    if missing:
        where = "transformer_layer_config" if nested else "config.json"
        raise BaseDrafterError(path, [f"{where} lacks {', '.join(missing)}"])
    try:
        shape = _shape(cfg, layer, weights, d2t, t2d, embed, aux)
    except ValueError as e:  # a config no drafter of ours can have
        raise BaseDrafterError(path, [f"config.json: {e}"]) from None
    broken = non_finite_problem(tensors)
    if broken:
        raise BaseDrafterError(path, [broken])
    return BaseDrafter(
        path=path, layout=layout, weights=weights, d2t=d2t, t2d=t2d, embed=embed, shape=shape,
        aux_layer_ids=None if aux is None else [int(i) for i in aux],
        unsupported_flags=_unsupported(cfg, layer))


def non_finite_problem(tensors: dict[str, TensorLike]) -> Optional[str]:
    """The first tensor with NaN or infinite values, named as its file spells it, with how many
    more there are; None when all are finite. Such a base would otherwise be found only as a
    non-finite loss at training's first step, or shipped. Reads every float tensor once, a block
    of rows at a time."""
    broken = [(k, t) for k, t in sorted(tensors.items()) if not all_finite(t)]
    if not broken:
        return None
    key, first = broken[0]
    where = f"`{first.key}` in {first.file.name}" if isinstance(first, LazyTensor) else f"`{key}`"
    more = f" (and {len(broken) - 1} more tensors)" if len(broken) > 1 else ""
    return (f"{where} has NaN or infinite values{more}: the drafter's weights are broken; "
            f"use another checkpoint of it")


def _shape(cfg: dict[str, Any], layer: dict[str, Any], weights: dict[str, TensorLike],
           d2t: Optional[torch.Tensor], t2d: Optional[torch.Tensor],
           embed: Optional[TensorLike], aux: Optional[list[int]]) -> DraftModelConfig:
    """The base's shape and numerics: from its config, else read off its tensors."""
    nested = _has_nested_config(cfg)
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    layer_ids = {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}
    gate = weights.get("layers.0.mlp.gate_proj.weight")
    q_proj = weights.get("layers.0.self_attn.q_proj.weight")  # head_dim when config omits it
    lm_head = weights.get("lm_head.weight")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is None:
        draft_vocab = len(d2t) if d2t is not None else (
            lm_head.shape[0] if lm_head is not None else layer.get("vocab_size"))
    vocab = layer.get("vocab_size")
    if vocab is None:
        vocab = len(t2d) if t2d is not None else (embed.shape[0] if embed is not None else 0)
    theta = _rope_theta(layer)
    target_hidden = int(cfg.get("target_hidden_size") or layer.get("target_hidden_size")
                        or hidden)
    fc = weights.get("fc.weight")
    num_aux = (fc.shape[1] // target_hidden if fc is not None and fc.dim() == 2
               else len(aux) if aux else 3)
    mla = _mla_shape(layer) if _is_mla(layer) else {"rope_scaling": _yarn(layer)}
    if _is_mla(layer):  # every head reads the one latent; the head width is the query/key one
        layer = {**layer, "num_key_value_heads": heads,
                 "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]}
    return DraftModelConfig(
        **mla,
        hidden_size=hidden, target_hidden_size=target_hidden, num_aux=num_aux,
        intermediate_size=int(layer.get("intermediate_size",
                                        gate.shape[0] if gate is not None else 0)),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or (q_proj.shape[0] // heads if q_proj is not None
                                                 else hidden // heads)),
        num_layers=int(layer.get("num_hidden_layers", max(layer_ids, default=0) + 1)),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta if theta is not None else 10000.0,  # transformers' Llama default
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        vocab_size=int(vocab), draft_vocab_size=int(draft_vocab or 0),
        # speculators (and vLLM reading a speculators config) default to true when absent;
        # SGLang/EAGLE have only the false variant.
        norm_before_residual=bool(cfg.get("norm_before_residual", nested)),
        # EAGLE-3.1: top-level flags in every engine's reader (SGLang also takes its older
        # `use_aux_norm`); an engine builds the norms from the flag, not from the weights
        fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
        norm_output=bool(cfg.get("norm_output")))


CONVENTIONS = {"minus_one": -1, "as_is": 0, "plus_one": 1}
"""Readings of a base drafter's written aux ids: HF indices = written + offset."""


def written_aux_ids(path: str | Path) -> Optional[list[int]]:
    """The aux ids a base drafter's config.json writes, without loading its weights: SGLang /
    AQ-MedAI configs keep them in `eagle_config` (the only place SGLang reads), speculators and
    vLLM configs at top level."""
    cfg_file = Path(path).expanduser() / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        raise BaseDrafterError(Path(path), ["config.json missing or not valid JSON"]) from None
    ids = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or cfg.get("eagle_aux_hidden_state_layer_ids"))
    return None if ids is None else [int(i) for i in ids]


def candidate_aux_ids(written: list[int], num_layers: int) -> dict[str, list[int]]:
    """Each reading of `written` that names valid layers (1..num_layers) of the verifier."""
    out = {}
    for name, delta in CONVENTIONS.items():
        ids = [i + delta for i in written]
        if all(1 <= i <= num_layers for i in ids):
            out[name] = ids
    return out


def vocab_maps(base: BaseDrafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a base drafter; a full-vocabulary one that ships neither (vLLM could not
    load them; docs/engines.md "Full vocabulary") has the identity map."""
    if base.d2t is not None and base.t2d is not None:
        return base.d2t, base.t2d
    shape = base.shape
    if base.d2t is None and base.t2d is None and shape.full_vocab and shape.vocab_size > 0:
        return (torch.zeros(shape.vocab_size, dtype=torch.int64),
                torch.ones(shape.vocab_size, dtype=torch.bool))
    raise BaseDrafterError(base.path, [
        f"`d2t`/`t2d` missing for a {shape.draft_vocab_size}-token draft vocabulary of "
        f"{shape.vocab_size}: without them engines map draft id i to token i and accept "
        f"almost nothing"])


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The (d2t, t2d) of a base drafter (`vocab_maps`), read without its other weights when it
    ships them."""
    path = Path(path).expanduser()
    tensors = _read_weights(path)
    if "d2t" in tensors and "t2d" in tensors:
        return load_tensor(tensors["d2t"]), load_tensor(tensors["t2d"])
    return vocab_maps(load(path))


def finetune_draft_config(draft_cfg: DraftModelConfig, base: BaseDrafter,
                          intermediate_size: Optional[int] = None) -> DraftModelConfig:
    """Our draft config for fine-tuning `base`: what we derive from the verifier, the base decides.

    Taken from the base (its weights were trained with them, and for a fresh drafter they are
    only verifier-derived defaults): attention geometry (heads, KV heads, head_dim), MLP width
    unless the user set `draft.intermediate_size` (pass it as `intermediate_size`), RMSNorm
    eps, RoPE theta and context length. Kept from `draft_cfg` and compared by `check_base`:
    hidden sizes, aux count and vocabulary (fixed by the verifier and 03_vocab), num_layers and
    norm_before_residual (the user's draft section).
    """
    b = base.shape
    mla = {k: getattr(b, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                      "qk_rope_head_dim", "v_head_dim", "rope_scaling")}
    return dataclasses.replace(
        draft_cfg, num_attention_heads=b.num_attention_heads,
        num_key_value_heads=b.num_key_value_heads, head_dim=b.head_dim,
        intermediate_size=intermediate_size or b.intermediate_size,
        rms_norm_eps=b.rms_norm_eps, rope_theta=b.rope_theta,
        max_position_embeddings=max(draft_cfg.max_position_embeddings,
                                    b.max_position_embeddings),
        # the MLA geometry and its rope scaling, when the attention is the base's (compared
        # by check_base: the user's `draft.attention` names the layer to build)
        **(mla if b.attention == draft_cfg.attention else {}))


def _file_key(base: BaseDrafter, key: str) -> str:
    """`key` as the base's file spells it, for messages."""
    return rename_key(key, "speculators", "sglang") if base.layout == "sglang" else key


def _config_problems(base: BaseDrafter, draft_cfg: DraftModelConfig,
                     allow_remap: bool) -> list[str]:
    """The config facts no tensor shape shows: heads, head_dim, norm placement, eps, theta."""
    problems = [f"config: {u}" for u in base.unsupported_flags]
    # Our drafter's widths and vocabulary are the verifier's (stage 04 derives them from it).
    problems += verifier_fit_problems(base.shape, draft_cfg.target_hidden_size,
                                      draft_cfg.vocab_size)
    facts = ["num_aux", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "num_layers"] + ([] if allow_remap else ["draft_vocab_size"])
    for name in facts:
        want, got = getattr(draft_cfg, name), getattr(base.shape, name)
        if want != got:
            problems.append(f"config: base has {name}={got}, our drafter {name}={want}")
    if base.shape.attention != draft_cfg.attention:
        problems.append(f"config: base has {base.shape.attention.upper()} attention, our "
                        f"drafter {draft_cfg.attention.upper()}: set draft.attention="
                        f"{base.shape.attention}")
    elif base.shape.attention == "mla":
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "rope_scaling"):
            want, got = getattr(draft_cfg, name), getattr(base.shape, name)
            if want != got:
                problems.append(f"config: base has {name}={got}, our drafter {name}={want}")
    if base.shape.norm_before_residual != draft_cfg.norm_before_residual:
        problems.append(f"config: base was trained with norm_before_residual="
                        f"{base.shape.norm_before_residual}, our drafter has "
                        f"{draft_cfg.norm_before_residual}: set draft.norm_before_residual="
                        f"{str(base.shape.norm_before_residual).lower()}")
    for name in ("fc_norm", "norm_output"):  # EAGLE-3.1: the base's weights need its norms
        if getattr(base.shape, name) != getattr(draft_cfg, name):
            problems.append(f"config: base has {name}={getattr(base.shape, name)}, our drafter "
                            f"{getattr(draft_cfg, name)}: set draft.{name}="
                            f"{str(getattr(base.shape, name)).lower()}")
    for name in ("rms_norm_eps", "rope_theta"):
        if float(getattr(base.shape, name)) != float(getattr(draft_cfg, name)):
            problems.append(f"config: base has {name}={getattr(base.shape, name)}, our drafter "
                            f"{getattr(draft_cfg, name)} (build it with "
                            f"finetune_draft_config)")

    return problems


def verifier_fit_problems(shape: DraftModelConfig, verifier_hidden: Optional[int],
                          verifier_vocab: Optional[int]) -> list[str]:
    """Why a drafter of `shape` cannot serve a verifier `verifier_hidden` wide with
    `verifier_vocab` tokens ([] when it can), for stage 04's base and `05_fix_keys.py --from`
    alike. Engines give the drafter the verifier's embedding (our exports ship none), so its
    hidden size must be the verifier's; it reads the verifier's aux states, so its
    `target_hidden_size` must be too. Without a verifier (None) only the two must agree."""
    problems = []
    if verifier_hidden is None and shape.hidden_size != shape.target_hidden_size:
        problems.append(f"the drafter is {shape.hidden_size} wide (hidden_size) but reads "
                        f"{shape.target_hidden_size}-wide verifier states "
                        f"(target_hidden_size): engines give it the verifier's "
                        f"{shape.target_hidden_size}-wide embedding, which it cannot take")
    if verifier_hidden is not None and shape.hidden_size != verifier_hidden:
        problems.append(f"the drafter is {shape.hidden_size} wide (hidden_size), the verifier "
                        f"{verifier_hidden}: engines give it the verifier's {verifier_hidden}-"
                        f"wide embedding; it was made for another verifier")
    if verifier_hidden is not None and shape.target_hidden_size != verifier_hidden:
        problems.append(f"the drafter reads {shape.target_hidden_size}-wide verifier states "
                        f"(target_hidden_size), the verifier's are {verifier_hidden} wide: it "
                        f"was made for another verifier")
    if verifier_vocab is not None and shape.vocab_size != verifier_vocab:
        problems.append(f"the drafter's vocabulary has {shape.vocab_size} tokens (vocab_size), "
                        f"the verifier's {verifier_vocab}: it was made for another verifier")
    return problems


def check_base(base: BaseDrafter, draft_cfg: DraftModelConfig, verifier_embed: torch.Tensor,
               d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None,
               allow_remap: bool = False) -> None:
    """Raise one BaseDrafterError naming every way `base` disagrees with our drafter.

    Checks the config facts that no tensor shape shows (heads, head_dim, norm placement,
    eps, RoPE theta), every tensor's presence, shape and dtype against `draft_cfg`, the base's
    own d2t/t2d (offsets onto the ids t2d marks), its `embed_tokens` (if shipped) against the
    verifier's, and its vocabulary map against ours (`d2t`/`t2d` from 03_vocab) unless
    `allow_remap`, in which case its lm_head/d2t may have another draft size.
    """
    problems = _config_problems(base, draft_cfg, allow_remap)
    shape_cfg = draft_cfg
    if allow_remap and base.shape.draft_vocab_size > 0:
        shape_cfg = dataclasses.replace(draft_cfg, draft_vocab_size=base.shape.draft_vocab_size)
    expected = expected_tensors(shape_cfg, "speculators")
    present = dict(base.weights)
    for name, t in (("d2t", base.d2t), ("t2d", base.t2d)):
        if t is not None and name in expected:  # a full vocabulary's map is checked below
            present[name] = t
    problems += [p.replace(", expected [", ", our drafter expects [")
                 for p in tensor_problems(expected, present, lambda k: _file_key(base, k))]
    if (base.d2t is not None and base.t2d is not None and base.d2t.dtype == torch.int64
            and base.t2d.dtype == torch.bool and base.t2d.numel() == base.shape.vocab_size):
        problems += [f"base {p}" for p in vocab_map_problems(
            base.d2t, base.t2d, base.d2t.numel(), base.shape.vocab_size)]

    if base.embed is not None:
        problems += embedding_problems(base.embed, verifier_embed)

    try:  # the identity for a full vocabulary shipped without a map
        theirs_map: Optional[tuple[torch.Tensor, torch.Tensor]] = vocab_maps(base)
    except BaseDrafterError:
        theirs_map = None  # reported above as missing tensors
    if d2t is not None and t2d is not None and not allow_remap and theirs_map is not None:
        base_d2t, base_t2d = theirs_map
        same = (base_d2t.shape == d2t.shape and base_t2d.shape == t2d.shape
                and torch.equal(base_d2t, d2t.to(base_d2t.dtype))
                and torch.equal(base_t2d, t2d.to(base_t2d.dtype)))
        if not same:
            ours = set((torch.arange(len(d2t)) + d2t).tolist())
            theirs = set((torch.arange(len(base_d2t)) + base_d2t).tolist())
            problems.append(
                f"vocabulary map differs from 03_vocab's ({len(theirs - ours)} of the base's "
                f"{len(theirs)} draft tokens are not in ours): its lm_head rows would score "
                f"the wrong tokens. Rerun 03_build_vocab_map.py with vocab.from_checkpoint=true "
                f"(the default when fine-tuning), or set vocab.allow_remap=true to move lm_head "
                f"rows by token")
    if problems:
        raise BaseDrafterError(base.path, problems)


def base_state_dict(base: BaseDrafter, verifier_embed: torch.Tensor,
                    d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None,
                    lm_head: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """State dict for `Eagle3DraftModel.load_state_dict` (strict) from a checked base.

    The embedding is always the verifier's (equal to the base's when it ships one). `d2t`,
    `t2d` and `lm_head` replace the base's after a remap (`eagle3.vocab.remap_lm_head`).
    """
    state = {k: load_tensor(v) for k, v in base.weights.items()}
    state["embed_tokens.weight"] = verifier_embed
    d2t, t2d = (d2t, t2d) if d2t is not None and t2d is not None else vocab_maps(base)
    if len(d2t) != len(t2d):  # a full vocabulary's identity map is not in the state dict
        state["d2t"], state["t2d"] = d2t, t2d
    if lm_head is not None:
        state["lm_head.weight"] = lm_head
    return state


def embedding_problems(embed: TensorLike, verifier_embed: TensorLike) -> list[str]:
    """A drafter's own `embed_tokens` against the verifier's: engines serve it with the
    verifier's (docs/engines.md, "Embedding"), so a different one means it was trained for
    another verifier (TorchSpec#38). Compared a block of rows at a time."""
    if tuple(embed.shape) != tuple(verifier_embed.shape):
        return [f"`embed_tokens.weight` has shape {list(embed.shape)}, the verifier's "
                f"embedding {list(verifier_embed.shape)}"]
    diff = max_abs_difference(embed, verifier_embed)
    if diff > 0:
        return [f"`embed_tokens.weight` differs from the verifier's embedding (max abs diff "
                f"{diff:.3g}): the drafter was trained for another verifier, and engines serve "
                f"it with the verifier's embedding (TorchSpec#38)"]
    return []
