"""End-to-end on the real engine: a random-weight EAGLE-3 drafter for SmolLM2-135M-Instruct is
exported by stage 05 and served by vllm-cpu next to the verifier by stage 06 (~2-3 min).

    .venv/bin/pytest tests/test_vllm_serve.py -q -m slow

Random weights accept (almost) nothing; what is checked is that vLLM loads the export without
complaint, captures the aux layers we wrote, and drafts.
"""

import importlib.util
import json
import time

import pytest

from conftest import VLLM_CPU_ENV
from eagle3 import checkpoint, formats
from eagle3.model import DraftModelConfig, Eagle3DraftModel

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm-cpu not installed")]

_DRAFT_VOCAB = 8192


def test_random_drafter_serves_in_vllm(tmp_path, smollm2):
    from conftest import make_config
    from eagle3.bench import run_bench
    from eagle3.export import run_export
    from eagle3.runs import Stage

    cfg = make_config(
        tmp_path, smollm2, vocab={"draft_vocab_size": _DRAFT_VOCAB},
        export={"formats": ["vllm"]},
        bench={"engines": [{"name": "vllm", "depths": [3], "baseline": False, "server": {
            "max_model_len": 512, "startup_timeout_s": 240.0,
            "dtype": "native", "extra_args": ["--enforce-eager"],
            "env": VLLM_CPU_ENV}}],
            "num_prompts": 3, "max_tokens": 16, "concurrency": [3], "expect_trained": False})
    info = cfg.verifier_info
    draft = DraftModelConfig(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size, num_aux=3,
        intermediate_size=info.intermediate_size, num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim, num_layers=1,
        rms_norm_eps=1e-5, rope_theta=info.rope_theta,
        max_position_embeddings=info.max_position_embeddings, vocab_size=info.vocab_size,
        draft_vocab_size=_DRAFT_VOCAB)
    model = Eagle3DraftModel(draft)
    model.t2d[:_DRAFT_VOCAB] = True  # identity prefix: offsets are all zero
    aux = list(info.aux_layer_ids)

    train = Stage(cfg, 4)
    train.dir.mkdir(parents=True)
    spec = formats.speculators_config(draft, aux, formats.ExportContext(
        str(cfg.verifier_path), info.architecture))
    path = checkpoint.save(train.dir, 1, model.trainable_state_dict(), draft, aux, spec,
                           {"world_size": 1}, recipe={})
    checkpoint.set_best(train.dir, path)
    train.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())

    run_export(Stage(cfg, 5))
    stage = Stage(cfg, 6)
    run_bench(stage)

    result = json.loads((stage.dir / "results" / "vllm-3_1_4-c3-mtbench-t0.json").read_text())
    assert result["num_drafts"] > 0 and result["num_requests"] == 3
    assert result["per_position_acceptance"] and len(result["per_position_acceptance"]) == 3
    log = (stage.dir / "logs" / "vllm-3_1_4.log").read_text()
    assert f"Using auxiliary layers from speculative config: {tuple(aux)}" in log
    assert "Attempted to load weight" not in log  # exported in the serving dtype
    assert "Detected EAGLE model with distinct lm_head weights" in log


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


@pytest.mark.parametrize("layout", ["speculators-save-pretrained", "aq-medai", "yarn-llama"])
def test_converted_drafters_serve_in_vllm(tmp_path, smollm2, cpu_flags, layout):
    """`05_fix_keys.py --from` a drafter written by speculators' own save_pretrained, one in
    AQ-MedAI's midlayer.* layout (embedding shipped), and one in that layout with YaRN rope
    scaling (lightseekorg's Llama-layer Kimi drafter's form): vLLM serves the vLLM export,
    drafting from the aux layers we trained on. Served as an AVX2-only CPU serves them (AVX2
    kernels, float32), whatever this CPU has: the native kernels serve the random drafter above
    and the trained one in tests/test_e2e.py."""
    from test_convert import aq_medai_dir, convert_dir, drafter_for, speculators_dir

    from conftest import AVX2_ENV, AVX2_FLAGS, make_config
    from eagle3 import bench, engines
    from eagle3.config import ServerConfig

    cpu_flags(AVX2_FLAGS)  # `dtype: native` as an AVX2 CPU resolves it: float32
    model = drafter_for(smollm2, heads=9, kv_heads=3)  # SmolLM2's embedding and head shape
    if layout in ("aq-medai", "yarn-llama"):
        # Written for SGLang and a Llama verifier: [1,2,3] - 1.
        src = aq_medai_dir(tmp_path / "src", model, aux=[0, 1, 2],
                           **({"rope_scaling": YARN} if layout == "yarn-llama" else {}))
    else:
        src = speculators_dir(tmp_path / "src", model)
    convert_dir(src, tmp_path / "out", "--verifier", str(smollm2), "--formats", "vllm",
                "--dtype", "bfloat16")
    cfg = make_config(tmp_path, smollm2)
    server = ServerConfig(startup_timeout_s=240.0, max_model_len=512, dtype="native",
                          extra_args=["--enforce-eager"], env={**VLLM_CPU_ENV, **AVX2_ENV})
    log = tmp_path / "vllm.log"
    with engines.start_server("vllm", cfg, server, "test", log, max_model_len=512,
                              args=bench.vllm_speculative_args(tmp_path / "out" / "vllm", 3)
                              ) as s:
        before = bench.spec_counters(engines.http_get(s.url("/metrics"), server))
        reply = engines.http_post_json(s.url("/v1/chat/completions"), {
            "model": engines.served_model(s.url(""), server),
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16, "temperature": 0}, server)
        after = bench.spec_counters(engines.http_get(s.url("/metrics"), server))
    assert reply["choices"][0]["message"]["content"]
    assert bench.acceptance_stats(before, after)["num_drafts"] > 0
    text = log.read_text()
    assert "Using auxiliary layers from speculative config: (1, 2, 3)" in text
    assert "Attempted to load weight" not in text
    assert "eagle3 plugin: vLLM-CPU kernels loaded: _C_AVX2\n" in text
    assert "dtype=torch.float32" in text
    if layout == "yarn-llama":
        written = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
        scaling = written.get("rope_scaling") or written.get("rope_parameters")
        assert scaling and scaling.get("factor") == 4.0 and \
            "yarn" in (scaling.get("type"), scaling.get("rope_type")), written


@pytest.mark.parametrize("cpu", ["native", "avx2"])
def test_mla_drafter_loads_whole_in_vllm_cpu(tmp_path, smollm2, cpu_flags, cpu):
    """An MLA drafter (`draft.attention: mla`, Kimi's widths) in lightseekorg's layout, converted
    by `--from`: vLLM's own config resolution takes our export as Eagle3DeepseekV2ForCausalLM (a
    `deepseek_v3` model_type would be rewritten to DeepSeek's MTP module and refused), its strict
    loader fills every drafter parameter, and it captures the aux layers we trained on. Beside
    this Llama verifier vLLM then stops where `mla_eagle3_problem` predicts, with the error it
    quotes: without AMX at the KV cache (no common block size), with AMX at the first request
    (its MLA metadata checks the verifier's head size, 64). `avx2` runs vLLM-CPU's AVX2 path (no
    AMX, whatever this CPU has) with the prediction made for an AVX2 CPU, so both branches run on
    any machine. An MLA drafter beside an MLA verifier drafts in vLLM-CPU with AMX:
    tests/test_rehearsal.py, `ft-mla`."""
    import dataclasses

    import torch
    from test_convert import convert_dir, draft_config, lightseek_mla_dir

    from conftest import AVX2_ENV, AVX2_FLAGS, make_config
    from eagle3 import bench, engines
    from eagle3.config import DraftConfig, ServerConfig
    from eagle3.cpu import features, mla_eagle3_problem
    from eagle3.verifier import read_tensor

    engine_env = VLLM_CPU_ENV
    if cpu == "avx2":
        cpu_flags(AVX2_FLAGS)
        engine_env = {**VLLM_CPU_ENV, **AVX2_ENV}
    embed = read_tensor(smollm2, "embed")
    vocab, hidden = embed.shape
    cfg = dataclasses.replace(draft_config(vocab, hidden, 9, 9), attention="mla", head_dim=192,
                              q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, draft_vocab_size=vocab)
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    src = lightseek_mla_dir(tmp_path / "src", model, aux=[0, 1, 2])  # SGLang's, Llama target
    convert_dir(src, tmp_path / "out", "--verifier", str(smollm2), "--formats", "vllm",
                "--dtype", "bfloat16")
    mla = {k: getattr(cfg, k) for k in DraftConfig.MLA_DIMS}
    run_cfg = make_config(tmp_path, smollm2, draft={"attention": "mla", **mla},
                          export={"formats": ["vllm", "sglang"]})
    server = ServerConfig(startup_timeout_s=240.0, max_model_len=512, dtype="native",
                          extra_args=["--enforce-eager"], env=engine_env)
    log = tmp_path / "vllm.log"
    problem = mla_eagle3_problem(run_cfg)
    try:
        with engines.start_server("vllm", run_cfg, server, "test", log, max_model_len=512,
                                  args=bench.vllm_speculative_args(tmp_path / "out" / "vllm", 3)
                                  ) as s:
            engines.http_post_json(s.url("/v1/chat/completions"), {
                "model": engines.served_model(s.url(""), server),
                "messages": [{"role": "user", "content": "Name three colours."}],
                "max_tokens": 16, "temperature": 0}, server)
        served = True
    except Exception:  # noqa: BLE001 - judged by the log below
        served = False
    text = log.read_text()
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in text
    drafter = text[text.index("Loading drafter model"):]
    assert "Loading weights took" in drafter  # strict: every parameter from the checkpoint
    assert "were not initialized from checkpoint" not in text
    assert "Using auxiliary layers from speculative config: (1, 2, 3)" in text
    assert f"Using {'AMX_MLA' if features().amx else 'CPU_MLA'} backend" in drafter
    if cpu == "avx2":
        assert "eagle3 plugin: vLLM-CPU kernels loaded: _C_AVX2\n" in text
    assert problem and not served
    said = [e for e in ("No common block size", "Head dimension 64 is not supported by MLA")
            if e in problem]
    assert said and said[0] in text, (problem, text[-3000:])
