"""Training checkpoints (`04_train/step-N/`), selective reads of the verifier's weights, and
base drafters for `--finetune-from`.

A checkpoint directory is built under a temporary name and renamed, so every `step-N/` that
exists is complete; `latest` and `best` are small pointer files replaced atomically after the
directory exists. Each holds:
  model.safetensors   the drafter (speculators layout `layers.N.*`, d2t, t2d; no embedding)
  config.json         speculators-format config (vLLM can serve the directory as is)
  draft_config.json   our DraftModelConfig + aux ids (shape-defining facts for resume)
  trainer_state.pt    optimizer, scheduler, TrainState (step, data position, best metric), RNG

A base drafter (SGLang/EAGLE, speculators or vLLM layout; single-file, sharded or .bin) is
read by `load_base_drafter` into our internal names and checked by `check_base`, which lists
every missing, unexpected or mis-shaped tensor, a foreign embedding and a different
vocabulary map in one error.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.formats import (COMPILE_PREFIX, SPECULATORS_TO_SGLANG, FormatError,
                            detect_layout, expected_tensors, strip_compile_prefix,
                            to_speculators_keys, vocab_map_problems)
from eagle3.model import DraftModelConfig
from eagle3.runs import StageError, atomic_dir, atomic_write_text

STEP_RE = re.compile(r"^step-(\d+)$")
REQUIRED = ("model.safetensors", "config.json", "draft_config.json", "trainer_state.pt")


# ---------------------------------------------------------------------------------------------
# Verifier weights, read tensor by tensor (a 1T-parameter checkpoint is never loaded whole)


def _weight_files(verifier: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = verifier / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: verifier / v for k, v in weight_map.items()}
    single = verifier / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {verifier}")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


# Name candidates: plain causal LMs, and multimodal wrappers whose text model sits under
# `language_model` (Kimi-K2.5).
_CANDIDATES = {
    "embed": ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
              "model.language_model.embed_tokens.weight"],
    "lm_head": ["lm_head.weight", "language_model.lm_head.weight"],
    "norm": ["model.norm.weight", "language_model.model.norm.weight",
             "model.language_model.norm.weight"],
}


def read_verifier_tensor(verifier: Path, what: str) -> torch.Tensor:
    """The verifier's `embed`, `lm_head` (tied heads fall back to the embedding) or final
    `norm` weight, reading only that tensor from disk."""
    files = _weight_files(verifier)
    names = _CANDIDATES[what] + (_CANDIDATES["embed"] if what == "lm_head" else [])
    for name in names:
        if name in files:
            with safe_open(str(files[name]), "pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"verifier {verifier} has none of {names}")


# ---------------------------------------------------------------------------------------------
# Step checkpoints


def step_dirs(train_dir: Path) -> list[tuple[int, Path]]:
    out = []
    if train_dir.is_dir():
        for p in train_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and all((p / f).is_file() for f in REQUIRED):
                out.append((int(m.group(1)), p))
    return sorted(out)


def read_pointer(train_dir: Path, name: str) -> Path | None:
    ptr = train_dir / name
    if not ptr.is_file():
        return None
    target = train_dir / ptr.read_text().strip()
    return target if target.is_dir() else None


def find_latest(train_dir: Path) -> Path | None:
    """The newest complete step directory (the pointer may lag a crash by one checkpoint)."""
    dirs = step_dirs(train_dir)
    return dirs[-1][1] if dirs else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(train_dir: Path, step: int, weights: dict[str, torch.Tensor],
                    speculators_config: dict[str, Any], draft_config: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write `step-N/` atomically and point `latest` at it."""
    path = train_dir / f"step-{step}"
    if path.exists():  # a previous run got this far; the content is identical by determinism
        shutil.rmtree(path)
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(speculators_config, indent=2) + "\n")
        (tmp / "draft_config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
        torch.save(trainer_state, tmp / "trainer_state.pt")
    atomic_write_text(train_dir / "latest", path.name + "\n")
    return path


def set_best(train_dir: Path, path: Path) -> None:
    atomic_write_text(train_dir / "best", path.name + "\n")


def prune(train_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories, never the one `best` points to."""
    best = read_pointer(train_dir, "best")
    dirs = step_dirs(train_dir)
    for _, p in dirs[:-keep]:
        if best is None or p.resolve() != best.resolve():
            shutil.rmtree(p)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, draft_config, trainer_state) of a step directory."""
    weights = load_file(str(path / "model.safetensors"))
    draft_config = json.loads((path / "draft_config.json").read_text())
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    return weights, draft_config, state


# ---------------------------------------------------------------------------------------------
# Base drafter (`--finetune-from`): any published layout, read into our internal names


class BaseDrafterError(StageError):
    """A base drafter that cannot be fine-tuned as is; `problems` lists every issue found."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"base drafter {path} is unusable ({len(problems)} problem(s)):\n"
                         f"{lines}")


@dataclass
class BaseDrafter:
    """A pretrained drafter as read from disk: weights under our names plus its shape facts.

    `weights` holds everything but the vocabulary maps and the embedding (`fc.weight`,
    `layers.N.*`, `norm.weight`, `lm_head.weight`, and anything unexpected, kept so that
    `check_base` can name it). Shape facts come from its config.json; where that is silent they
    are read off the tensors.
    """
    path: Path
    layout: str
    """`sglang` (midlayer.*, flat LlamaForCausalLMEagle3 config), `speculators` (nested
    transformer_layer_config) or `vllm` (flat config, layers.N.* keys)."""
    weights: dict[str, torch.Tensor]
    d2t: Optional[torch.Tensor]
    t2d: Optional[torch.Tensor]
    embed: Optional[torch.Tensor]
    """`embed_tokens.weight` when the base ships one (it must equal the verifier's)."""
    shape: DraftModelConfig
    """Our model config with exactly the base's shape and numerics."""
    aux_layer_ids: Optional[list[int]]
    """As written in the base's config, in its engine's convention (see `aux_ids_internal`)."""
    unsupported_flags: list[str] = field(default_factory=list)
    """EAGLE-3.1 / speculators options set in the config that our model does not have."""

    def aux_ids_internal(self, sglang_convention: str = "post-25454") -> Optional[list[int]]:
        """The aux ids as HF `output_hidden_states` indices (our convention).

        vLLM and speculators write that convention; SGLang's config is shifted: post-#25454
        SGLang adds +1 when the first id is 1, pre-#25454 SGLang always adds +1.
        """
        ids = self.aux_layer_ids
        if ids is None or self.layout != "sglang":
            return ids
        if sglang_convention == "pre-25454" or (ids and ids[0] == 1):
            return [i + 1 for i in ids]
        return list(ids)


_WEIGHT_CANDIDATES = ("model.safetensors.index.json", "model.safetensors",
                      "pytorch_model.bin.index.json", "pytorch_model.bin")


def _read_weights(path: Path, only: Optional[set[str]] = None) -> dict[str, torch.Tensor]:
    """All tensors (or those named in `only`) of a single-file or sharded checkpoint."""
    found = next((path / n for n in _WEIGHT_CANDIDATES if (path / n).is_file()), None)
    if found is None:
        raise BaseDrafterError(path, [f"no weights: expected one of "
                                      f"{', '.join(_WEIGHT_CANDIDATES)}"])
    if found.name.endswith(".index.json"):
        weight_map = json.loads(found.read_text())["weight_map"]
        files: dict[Path, list[str]] = {}
        for key, name in weight_map.items():
            if only is None or key.removeprefix(COMPILE_PREFIX) in only:
                files.setdefault(path / name, []).append(key)
    else:
        files = {found: []}
    out: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        if not file.is_file():
            raise BaseDrafterError(path, [f"shard {file.name} named in the index is missing"])
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                for key in keys or f.keys():
                    if only is None or key.removeprefix(COMPILE_PREFIX) in only:
                        out[key] = f.get_tensor(key)
        else:  # pickled state dict: weights_only refuses anything but tensors and containers
            state = torch.load(file, map_location="cpu", weights_only=True)
            out.update({k: v for k, v in state.items()
                        if only is None or k.removeprefix(COMPILE_PREFIX) in only})
    return strip_compile_prefix(out)


def _has_nested_config(cfg: dict[str, Any]) -> bool:
    return isinstance(cfg.get("transformer_layer_config"), dict) or "speculators_model_type" in cfg


def _rope_theta(layer: dict[str, Any]) -> Optional[float]:
    params = layer.get("rope_parameters") or {}
    theta = layer.get("rope_theta", params.get("rope_theta"))
    return None if theta is None else float(theta)


def _unsupported(cfg: dict[str, Any], layer: dict[str, Any]) -> list[str]:
    """Options of the base our model does not implement (its weights would compute otherwise)."""
    out = [f"`{flag}` is true (EAGLE-3.1/speculators option our drafter does not have; a "
           f"speculators base must be trained with {flag}=false)"
           for flag in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(flag)]
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"`hidden_act` is {act!r}; our drafter's MLP is SiLU-gated")
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            out.append(f"`{flag}` is true; our drafter has no biases")
    scaling = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", None):
        out.append(f"rope scaling {kind!r}; our drafter uses plain RoPE")
    return out


def load_base_drafter(path: str | Path) -> BaseDrafter:
    """Read a pretrained EAGLE-3 drafter directory in any of the layouts we know.

    SGLang/EAGLE (`midlayer.*`, flat `LlamaForCausalLMEagle3` config, aux ids in
    `eagle_config`), speculators (`layers.N.*`, nested `transformer_layer_config`, top-level
    aux ids; `norm_before_residual` defaults to true there, as in speculators and vLLM) and
    vLLM-style (flat config, `layers.N.*`); weights in model.safetensors, a sharded
    model.safetensors.index.json, or pytorch_model.bin. Keys are mapped to our names through
    `eagle3.formats` and torch.compile's `_orig_mod.` is stripped. Nothing is checked against
    our config here: that is `check_base`.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise BaseDrafterError(path, ["not a directory (give the drafter's checkpoint folder)"])
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BaseDrafterError(path, ["config.json missing (the draft shape cannot be known)"])
    cfg = json.loads(cfg_file.read_text())
    tensors = _read_weights(path)
    try:
        key_layout = detect_layout(k for k in tensors if k not in ("d2t", "t2d"))
    except FormatError as e:
        raise BaseDrafterError(path, [str(e)]) from None
    weights = to_speculators_keys(tensors) if key_layout == "sglang" else dict(tensors)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
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
    shape = DraftModelConfig(
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
        norm_before_residual=bool(cfg.get("norm_before_residual", nested)))
    return BaseDrafter(
        path=path, layout=layout, weights=weights, d2t=d2t, t2d=t2d, embed=embed, shape=shape,
        aux_layer_ids=None if aux is None else [int(i) for i in aux],
        unsupported_flags=_unsupported(cfg, layer))


def load_base_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the (d2t, t2d) of a base drafter, read without loading its other weights."""
    path = Path(path).expanduser()
    tensors = _read_weights(path, only={"d2t", "t2d"})
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise BaseDrafterError(path, [f"`{k}` missing: the base's vocabulary map is unknown"
                                      for k in missing])
    return tensors["d2t"], tensors["t2d"]


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
    return dataclasses.replace(
        draft_cfg, num_attention_heads=b.num_attention_heads,
        num_key_value_heads=b.num_key_value_heads, head_dim=b.head_dim,
        intermediate_size=intermediate_size or b.intermediate_size,
        rms_norm_eps=b.rms_norm_eps, rope_theta=b.rope_theta,
        max_position_embeddings=max(draft_cfg.max_position_embeddings,
                                    b.max_position_embeddings))


def _file_key(base: BaseDrafter, key: str) -> str:
    """`key` as the base's file spells it, for messages."""
    if base.layout == "sglang":
        for ours, theirs in SPECULATORS_TO_SGLANG.items():
            if key.startswith(ours):
                return theirs + key[len(ours):]
    return key


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
    problems = [f"config: {u}" for u in base.unsupported_flags]
    facts = ["hidden_size", "target_hidden_size", "num_aux", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_layers",
             "vocab_size"] + ([] if allow_remap else ["draft_vocab_size"])
    for name in facts:
        want, got = getattr(draft_cfg, name), getattr(base.shape, name)
        if want != got:
            problems.append(f"config: base has {name}={got}, our drafter {name}={want}")
    if base.shape.norm_before_residual != draft_cfg.norm_before_residual:
        problems.append(f"config: base was trained with norm_before_residual="
                        f"{base.shape.norm_before_residual}, our drafter has "
                        f"{draft_cfg.norm_before_residual}: set draft.norm_before_residual="
                        f"{str(base.shape.norm_before_residual).lower()}")
    for name in ("rms_norm_eps", "rope_theta"):
        if float(getattr(base.shape, name)) != float(getattr(draft_cfg, name)):
            problems.append(f"config: base has {name}={getattr(base.shape, name)}, our drafter "
                            f"{getattr(draft_cfg, name)} (build it with "
                            f"finetune_draft_config)")

    shape_cfg = draft_cfg
    if allow_remap and base.shape.draft_vocab_size > 0:
        shape_cfg = dataclasses.replace(draft_cfg, draft_vocab_size=base.shape.draft_vocab_size)
    expected = expected_tensors(shape_cfg, "speculators")
    present = dict(base.weights)
    for name, t in (("d2t", base.d2t), ("t2d", base.t2d)):
        if t is not None:
            present[name] = t
    for key in sorted(set(expected) - set(present)):
        problems.append(f"missing tensor `{_file_key(base, key)}` (expected shape "
                        f"{list(expected[key][0])})")
    for key in sorted(set(present) - set(expected)):
        problems.append(f"unexpected tensor `{_file_key(base, key)}` "
                        f"{list(present[key].shape)} (our drafter has no such weight)")
    for key in sorted(set(present) & set(expected)):
        shape, dtype = expected[key]
        t = present[key]
        if tuple(t.shape) != shape:
            problems.append(f"`{_file_key(base, key)}` has shape {list(t.shape)}, our drafter "
                            f"expects {list(shape)}")
        elif dtype is not None and t.dtype != dtype:
            problems.append(f"`{key}` has dtype {t.dtype}, expected {dtype}")
        elif dtype is None and not t.is_floating_point():
            problems.append(f"`{_file_key(base, key)}` has dtype {t.dtype}, expected float")
    if (base.d2t is not None and base.t2d is not None and base.d2t.dtype == torch.int64
            and base.t2d.dtype == torch.bool and base.t2d.numel() == base.shape.vocab_size):
        problems += [f"base {p}" for p in vocab_map_problems(
            base.d2t, base.t2d, base.d2t.numel(), base.shape.vocab_size)]

    if base.embed is not None:
        if tuple(base.embed.shape) != tuple(verifier_embed.shape):
            problems.append(f"`embed_tokens.weight` has shape {list(base.embed.shape)}, the "
                            f"verifier's embedding {list(verifier_embed.shape)}")
        elif not torch.equal(verifier_embed.to(base.embed.dtype), base.embed):
            diff = float((verifier_embed.float() - base.embed.float()).abs().max())
            problems.append(f"`embed_tokens.weight` differs from the verifier's embedding (max "
                            f"abs diff {diff:.3g}): the base was trained for another verifier")

    if d2t is not None and t2d is not None and not allow_remap and base.d2t is not None \
            and base.t2d is not None:
        same = (base.d2t.shape == d2t.shape and base.t2d.shape == t2d.shape
                and torch.equal(base.d2t, d2t.to(base.d2t.dtype))
                and torch.equal(base.t2d, t2d.to(base.t2d.dtype)))
        if not same:
            ours = set((torch.arange(len(d2t)) + d2t).tolist())
            theirs = set((torch.arange(len(base.d2t)) + base.d2t).tolist())
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
    state = dict(base.weights)
    state["embed_tokens.weight"] = verifier_embed
    state["d2t"] = d2t if d2t is not None else base.d2t
    state["t2d"] = t2d if t2d is not None else base.t2d
    if lm_head is not None:
        state["lm_head.weight"] = lm_head
    return state
