"""The Kimi-K2.5 rehearsal at its smallest size (`make rehearse-kimi` is the full one): the
Kimi-shaped verifier (wrapper config, MLA/MoE, slow tiktoken tokenizer, thinking template)
through all six stages with vLLM-CPU serving it in stages 01 (as an AVX2-only CPU runs it:
float32 on the AVX2 kernels, with the MLA kernel such a CPU gets) and 06, then a drafter in
AQ-MedAI's published layout converted by `05_fix_keys.py --from` and fine-tuned from, and an MLA
drafter over the full vocabulary in lightseekorg's layout, likewise.

    .venv/bin/pytest tests/test_rehearsal.py -q -m slow
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import AVX2_ENV, REPO, VLLM_CPU_ENV
from eagle3.config import load_config
from eagle3.cpu import mla_eagle3_problem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm-cpu not installed")]

SMALLEST = ["data.num_samples=4", "generate.max_new_tokens=16", "train.epochs=2",
            "train.measure_samples=2", "bench.num_prompts=2", "bench.max_tokens=16"]
STAGE_01_ON_AVX2 = ["generate.server.dtype=float32", "generate.server.env=" + json.dumps(
    {**VLLM_CPU_ENV, **AVX2_ENV})]


def test_kimi_rehearsal(tmp_path, kimi_verifier):
    overrides = [f"run.dir={tmp_path}", f"verifier.path={kimi_verifier}", *SMALLEST,
                 *STAGE_01_ON_AVX2]
    out = subprocess.run([sys.executable, "-m", "eagle3.rehearsal",
                          "configs/kimi-k2.5-rehearsal.yaml", "--variants", "ft-embed,ft-mla",
                          *overrides], cwd=REPO, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fresh = tmp_path / "kimi-k2.5-rehearsal"
    ft = tmp_path / "kimi-k2.5-rehearsal-ft-embed"
    for run in (fresh, ft):
        for stage in ("02_hidden_states", "03_vocab", "04_train", "05_export", "06_bench"):
            assert (run / stage / "manifest.json").is_file(), (run, stage)
    data = json.loads((fresh / "01_data" / "manifest.json").read_text())
    assert data["engine"] == "vllm" and data["counts"]["samples"] > 0
    log = (fresh / "01_data" / "logs" / "vllm.log").read_text()
    assert "vLLM-CPU kernels loaded: _C_AVX2\n" in log and "dtype=torch.float32" in log
    bench = json.loads((fresh / "06_bench" / "results.json").read_text())["results"]
    spec = [r for r in bench if r["depth"]]
    assert spec and all(r["num_drafts"] > 0 for r in spec)  # drafted for Kimi
    # Without AMX, vLLM-CPU cannot pair the MLA verifier with a drafter (KV blocks of 16 vs
    # 32, docs/engines.md): the reference decoder measures stage 06, said in one line.
    engine = "vllm" if mla_eagle3_problem(load_config(
        REPO / "configs/kimi-k2.5-rehearsal.yaml", overrides)) is None else "hf"
    assert {r["engine"] for r in spec} == {engine}
    assert ("stage 06 uses the reference decoder, not vLLM" in out.stdout) == (engine == "hf")
    # Kimi's SGLang rule: ids [2,4,5] are captured as is after PR #25454, so the SGLang export
    # writes the robust [1,3,4] (valid before and after).
    export = json.loads((fresh / "05_export" / "report.json").read_text())["formats"]
    assert export["sglang"]["aux_layer_ids_written"] == [1, 3, 4]
    assert export["sglang"]["aux_ids_valid_for"] == ["sglang pre-25454", "sglang post-25454"]
    converted = json.loads((tmp_path / "kimi-k2.5-rehearsal-ft-embed-converted" /
                            "report.json").read_text())
    assert converted["unchecked"] == [] and sorted(converted["formats"]) == [
        "sglang", "speculators", "vllm"]
    train = json.loads((ft / "04_train" / "manifest.json").read_text())
    assert train["finetune_from"]["path"].endswith("kimi-k2.5-rehearsal-ft-embed-base")
    assert (ft / "04_train" / "base_aux_measurement.json").is_file()

    # ft-mla: an MLA drafter over Kimi's full vocabulary, in lightseekorg's layout (aux ids
    # written for SGLang: [1, 3, 4]), converted for vLLM and SGLang and fine-tuned from, as
    # configs/kimi-k2.5-mla.yaml does
    mla = tmp_path / "kimi-k2.5-rehearsal-ft-mla"
    base = json.loads((tmp_path / "kimi-k2.5-rehearsal-ft-mla-base" / "config.json").read_text())
    assert base["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert base["model_type"] == "kimi_k2" and base["rope_scaling"]["type"] == "yarn"
    assert base["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    converted = json.loads((tmp_path / "kimi-k2.5-rehearsal-ft-mla-converted" /
                            "report.json").read_text())
    assert converted["unchecked"] == [] and sorted(converted["formats"]) == ["sglang", "vllm"]
    train = json.loads((mla / "04_train" / "manifest.json").read_text())
    assert train["finetune_from"]["aux_layer_ids"] == [2, 4, 5]
    assert train["finetune_from"]["aux_layer_ids_as_written"] == [1, 3, 4]
    export = json.loads((mla / "05_export" / "report.json").read_text())["formats"]
    assert sorted(export) == ["sglang", "vllm"]
    assert all(r["attention"] == "mla" and r["full_vocab"] for r in export.values())
    bench = json.loads((mla / "06_bench" / "results.json").read_text())["results"]
    assert [r for r in bench if r["depth"]] and all(r["num_drafts"] > 0
                                                    for r in bench if r["depth"])
