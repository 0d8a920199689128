"""Everything read from the verifier's directory besides config.json: its tokenizer (with the
chat template the whole pipeline renders with), the token ids that end a turn, and single
weight tensors (embedding, lm_head, final norm), read one at a time so that a 1T-parameter
checkpoint is never loaded whole.

    tok = load_tokenizer(cfg)                      # every stage, trust_remote_code honoured
    eot = stop_token_ids(tok, cfg)                 # computed once per tokenizer
    embed = read_tensor(cfg.verifier_path, "embed")

Failures (no tokenizer, an unreadable or truncated weight file, a tensor that is not there)
are StageErrors of one line naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from eagle3.config import Config, expand_path
from eagle3.runs import StageError, safetensors_header
from eagle3.weights_io import (LazyTensor, WeightFilesError, listed_files, open_file,
                               weight_map)

# End-of-turn tokens of common templates. With the tokenizer's EOS and the generation config's
# EOS ids they are the ids that close an assistant turn (those the tokenizer knows as tokens).
END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_assistant_end|>",
                     "<｜end▁of▁sentence｜>")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template


def load_tokenizer(cfg: Config, padding_side: str = "right") -> Any:
    """The verifier's tokenizer (fast or slow, remote code when `verifier.trust_remote_code`),
    with `verifier.chat_template` applied when set. Every stage loads it through here."""
    from transformers import AutoTokenizer

    path = cfg.verifier_path
    if not path.is_dir():
        raise StageError(f"verifier.path {path} is not a directory: prepare the verifier or fix "
                         f"the path")
    try:
        tok = AutoTokenizer.from_pretrained(path, padding_side=padding_side,
                                            trust_remote_code=cfg.verifier.trust_remote_code)
    except Exception as e:  # missing files, remote code refused, a corrupt file: many types
        import transformers
        hint = ("; the tokenizer is custom code: set verifier.trust_remote_code=true"
                if "trust_remote_code" in str(e) else
                f"; its code imports what transformers {transformers.__version__} lacks: take "
                f"the model repository's newer code files (docs/errors.md)"
                if isinstance(e, ImportError) else "")
        raise StageError(f"verifier tokenizer in {path} cannot be loaded ({_first_line(e)})"
                         f"{hint}; check verifier.path") from None
    if cfg.verifier.chat_template:
        template = Path(expand_path(cfg.verifier.chat_template))
        if not template.is_file():
            raise StageError(f"verifier.chat_template: {template} does not exist; fix the path "
                             f"or set it to null")
        tok.chat_template = template.read_text()
    if not tok.chat_template:
        raise StageError(f"verifier {path} has no chat template: set verifier.chat_template to "
                         f"a Jinja file")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is always masked out; any id works
    return tok


def chat_template_path(cfg: Config) -> Path | None:
    """The template file engines must be started with, so they render as training did."""
    template = cfg.verifier.chat_template
    return Path(expand_path(template)).resolve() if template else None


def stop_token_ids(tokenizer: Any, cfg: Optional[Config] = None) -> list[int]:
    """Token ids that end an assistant turn: `verifier.stop_token_ids`, else the tokenizer's
    EOS, the generation config's EOS ids and the known end-of-turn tokens the vocabulary has.
    The one definition used by generation, loss masks, the draft vocabulary and the bench
    (`cfg` None: the tokenizer alone, for tests). Computed once per tokenizer (a 262k
    vocabulary takes 0.3 s to list)."""
    cached = getattr(tokenizer, "_eagle3_stop_ids", None)
    if cached is not None:
        return list(cached)
    if cfg is not None and cfg.verifier.stop_token_ids is not None:
        ids = list(cfg.verifier.stop_token_ids)
    else:
        ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if cfg is not None:
            ids += generation_eos_ids(cfg.verifier_path)
        vocab = tokenizer.get_vocab()
        ids += [vocab[name] for name in END_OF_TURN_NAMES if name in vocab]
    ids = list(dict.fromkeys(int(i) for i in ids))
    tokenizer._eagle3_stop_ids = tuple(ids)
    return ids


def generation_eos_ids(verifier_path: Path) -> list[int]:
    """`eos_token_id` of generation_config.json (an int or a list), [] when absent."""
    path = verifier_path / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        raise StageError(f"{path} is not valid JSON: restore or delete it") from None
    return [eos] if isinstance(eos, int) else [int(i) for i in eos or []]


# ---------------------------------------------------------------------------------------------
# Weights, one tensor at a time

# Name candidates: plain causal LMs, and multimodal wrappers whose text model sits under
# `language_model` (Kimi-K2.5).
TENSOR_NAMES = {
    "embed": ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
              "model.language_model.embed_tokens.weight"],
    "lm_head": ["lm_head.weight", "language_model.lm_head.weight"],
    "norm": ["model.norm.weight", "language_model.model.norm.weight",
             "model.language_model.norm.weight"],
}
LAYER_PREFIXES = ["model.", "language_model.model.", "model.language_model."]


def weight_files(verifier: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for single-file and sharded
    checkpoints: `weights_io.weight_map`, the map every reader of a weights directory uses (the
    index's, checked against what the shards hold)."""
    index = verifier / "model.safetensors.index.json"
    if not index.is_file() and not any(verifier.glob("*.safetensors")):
        bins = sorted(p.name for p in verifier.glob("*.bin"))
        hint = (f" (it has {bins[0]}: save the model with safetensors)" if bins else
                " (download the weights, or fix verifier.path)")
        raise StageError(f"verifier {verifier} has no model.safetensors or "
                         f"model.safetensors.index.json{hint}")
    try:
        return weight_map(verifier)
    except WeightFilesError as e:
        raise StageError(f"verifier {verifier}: {e.problems[0]}") from None


def check_weights(verifier: Path) -> None:
    """Every weight file of the verifier is present and whole (headers only: seconds even for
    64 shards), so a truncated download fails here with its name, not deep in a loader; and its
    index agrees with its shards (`weight_files`)."""
    try:
        files = listed_files(verifier)
    except WeightFilesError:
        files = []  # no weights, a bad index or a missing shard: weight_files names it
    for file in files:
        if safetensors_header(file) is None:
            raise StageError(f"verifier weights {file} are truncated or damaged (the header "
                             f"does not match the file size): restore the file")
    weight_files(verifier)


def read_tensor(verifier: Path, what: str) -> torch.Tensor:
    """The verifier's `embed`, `lm_head` (tied heads fall back to the embedding), final `norm`
    weight or a decoder layer's `layers.{i}.{name}`, reading only that tensor from disk."""
    return load_lazy(lazy_tensor(verifier, what))


def load_lazy(t: LazyTensor) -> torch.Tensor:
    """A `lazy_tensor`'s bytes; a damaged file is one clear error."""
    try:
        return t.load()
    except Exception as e:  # a truncated file fails here, not at open
        raise StageError(f"verifier weights {t.file} are unreadable ({_first_line(e)}): "
                         f"truncated or damaged; restore them") from None


def lazy_tensor(verifier: Path, what: str) -> LazyTensor:
    """`read_tensor`'s tensor, unread (shape and dtype from the file header). `what` is a key
    of TENSOR_NAMES or `layers.{i}.{name}` (a decoder layer's tensor, under the same wrappers)."""
    files = weight_files(verifier)
    if what.startswith("layers."):
        names = [prefix + what for prefix in LAYER_PREFIXES]
    else:
        names = TENSOR_NAMES[what] + (TENSOR_NAMES["embed"] if what == "lm_head" else [])
    for name in names:
        if name in files:
            try:
                return open_file(files[name])[name]
            except WeightFilesError as e:
                raise StageError(f"verifier weights {files[name]} are unreadable "
                                 f"({e.problems[0]}); restore them") from None
    raise StageError(f"verifier {verifier} has no {what} tensor (looked for {', '.join(names)})")


# ---------------------------------------------------------------------------------------------
# The text model, loaded by transformers (the decoder alone, or with its LM head)


def find_text_prefix(names: list[str]) -> str:
    """Checkpoint prefix of the text decoder ("model.", "language_model.model.",
    "model.language_model.", ...): the one whose embed_tokens, norm and layers.0 all exist."""
    keys = set(names)
    cands = [n[:-len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight")]
    cands = [p for p in cands if f"{p}norm.weight" in keys
             and any(n.startswith(f"{p}layers.0.") for n in keys)]
    if not cands:
        raise StageError("verifier checkpoint has no text decoder (`...embed_tokens.weight`, "
                         "`...norm.weight`, `...layers.0.*`): the hf backend cannot load it")
    # A multimodal checkpoint may hold other towers with their own embeddings; the language
    # model is the one named so, else the shortest prefix.
    return sorted(cands, key=lambda p: ("language_model" not in p, len(p)))[0]


def text_device_map(num_layers: int, devices: list[torch.device]) -> dict[str, str]:
    """Module -> device for the text decoder: layer i on devices[i * len(devices) // n]."""
    out = {"embed_tokens": str(devices[0]), "rotary_emb": str(devices[0]),
           "norm": str(devices[-1])}
    for i in range(num_layers):
        out[f"layers.{i}"] = str(devices[i * len(devices) // num_layers])
    return out


def text_config_of(path: Path, trust_remote_code: bool) -> Any:
    """The text model's transformers config. Kimi-K2.5's `text_config` says `model_type:
    kimi_k2`; transformers reads it as a DeepseekV3Config but keeps that name, and finds no
    checkpoint conversion under it (Kimi's per-expert weights then fail to load into
    DeepSeek-V3's fused experts): the config class's own model type is restored."""
    from transformers import AutoConfig

    text_cfg = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code).get_text_config(decoder=True)
    canonical = getattr(type(text_cfg), "model_type", None)
    if canonical and text_cfg.model_type != canonical:
        text_cfg.model_type = canonical
    return text_cfg


def load_text_decoder(path: Path, dtype: str, devices: list[torch.device],
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The verifier's text decoder alone (e.g. LlamaModel, DeepseekV3Model).

    Only the decoder's tensors are read, each once, straight to the device of the module that
    uses it: the checkpoint prefix of the text model (`model.`, `language_model.model.`, ...)
    is mapped away, so the lm_head, vision tower and MTP layers are skipped. transformers does
    the loading, so its checkpoint conversions (e.g. fused MoE experts) apply.
    """
    from transformers import AutoModel

    text_cfg = text_config_of(path, trust_remote_code)
    prefix = find_text_prefix(list(weight_files(path)))
    device_map = text_device_map(text_cfg.num_hidden_layers, devices)
    with _quiet_transformers():
        base, info = AutoModel.from_pretrained(
            path, config=text_cfg, dtype=getattr(torch, dtype), device_map=device_map,
            key_mapping={f"^{re.escape(prefix)}": ""}, trust_remote_code=trust_remote_code,
            output_loading_info=True)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise StageError(f"verifier checkpoint {path} lacks {prefix}{missing[0]} "
                         f"({len(missing)} decoder tensors missing)")
    return base.eval()


def load_text_lm(path: Path, dtype: str, device: str,
                 trust_remote_code: bool = False) -> torch.nn.Module:
    """The verifier's text model with its LM head, for generating in-process (stage 01's hf
    engine): a multimodal wrapper's language model alone, under its checkpoint prefix."""
    from transformers import AutoModelForCausalLM

    text_cfg = text_config_of(path, trust_remote_code)
    decoder = find_text_prefix(list(weight_files(path)))
    lm_prefix = decoder.removesuffix("model.")  # `language_model.` of `language_model.model.`
    mapping = {f"^{re.escape(lm_prefix)}": ""} if lm_prefix else None
    with _quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=text_cfg, dtype=getattr(torch, dtype), key_mapping=mapping,
            trust_remote_code=trust_remote_code, output_loading_info=True)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise StageError(f"verifier checkpoint {path} lacks {lm_prefix}{missing[0]} "
                         f"({len(missing)} tensors missing)")
    return model.to(device).eval()


def load_final_norm(path: Path, dtype: str, trust_remote_code: bool = False
                    ) -> torch.nn.Module:
    """The verifier's own final-norm module (its class, as transformers builds the decoder:
    LlamaRMSNorm, Gemma's `(1 + w)` RMSNorm, ...) with its weights from the checkpoint: what
    turns vLLM's pre-norm last state into the post-norm state the teacher reads.

    The decoder is built on the meta device (no memory, even at Kimi size) only to learn the
    class; a module with anything but the checkpoint's `norm.*` tensors is refused."""
    import copy

    from transformers import AutoModel

    text_cfg = text_config_of(path, trust_remote_code)
    with torch.device("meta"), _quiet_transformers():
        decoder = AutoModel.from_config(text_cfg, trust_remote_code=trust_remote_code)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise StageError(f"the verifier's decoder ({type(decoder).__name__}) has no final "
                         f"`norm` module: the vllm backend cannot post-norm its last state; use "
                         f"hidden_states.backend=hf")
    norm = copy.deepcopy(norm).to_empty(device="cpu")
    files = weight_files(path)
    prefix = find_text_prefix(list(files))
    state = {}
    for name, _ in list(norm.named_parameters()) + list(norm.named_buffers()):
        key = f"{prefix}norm.{name}"
        if key not in files:
            raise StageError(f"the verifier's final norm ({type(norm).__name__}) has "
                             f"`{name}` but the checkpoint no `{key}`: use "
                             f"hidden_states.backend=hf")
        state[name] = open_file(files[key])[key].load()
    norm.load_state_dict(state)
    return norm.to(getattr(torch, dtype)).eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Skipped tensors (vision tower, MTP layers) would fill the log with an "unexpected keys"
    report; missing ones are checked by the callers instead."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
