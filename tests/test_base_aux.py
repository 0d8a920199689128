"""Which verifier layers a base drafter was trained on, measured rather than guessed
(`train.base_aux_convention=measure`): a base trained on HF `hidden_states[2,3,4]` whose config
writes [1,2,3] (SGLang's convention for a Llama target) is recognised as `plus_one`.

    .venv/bin/pytest tests/test_base_aux.py -q
"""

import json
import shutil
from pathlib import Path

import pytest

from conftest import make_config
from eagle3 import checkpoint, formats
from eagle3.runs import Stage
from test_bad_inputs import one_line_error, run

DATA = {"num_samples": 12, "max_user_turns": 1, "max_seq_len": 96}
TRAIN = {"epochs": 25, "batch_tokens": 96, "checkpoint_every": 100, "ttt_steps": 2,
         "lr": 3e-3, "val_fraction": 0.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_verifier):
    """A drafter trained on hidden_states[2,3,4], exported in SGLang's layout: its config says
    [1,2,3] (SGLang adds +1 for Llama targets), the ambiguity AQ-MedAI's drafters carry."""
    tmp = tmp_path_factory.mktemp("base")
    cfg = make_config(tmp, tiny_verifier, verifier={"aux_layer_ids": [2, 3, 4]}, data=DATA,
                      train=TRAIN)
    for script in ("01_generate_data.py", "02_extract_hidden_states.py",
                   "03_build_vocab_map.py", "04_train.py"):
        out = run(script, cfg)
        assert out.returncode == 0, out.stderr[-3000:]
    c = checkpoint.load(checkpoint.resolve(Stage(cfg, 4).dir, "latest"))
    out = tmp / "base-sglang"
    out.mkdir()
    formats.write_export(out, "sglang", c.weights, c.draft, c.aux_layer_ids, formats.ExportContext(
        str(tiny_verifier), "LlamaForCausalLM"))
    assert json.loads((out / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    return cfg, out


def finetune_run(tmp: Path, tiny_verifier, base_cfg, base_dir, aux):
    cfg = make_config(tmp, tiny_verifier, verifier={"aux_layer_ids": aux}, data=DATA,
                      train={**TRAIN, "epochs": 1, "finetune_from": str(base_dir),
                             "base_aux_convention": "measure", "measure_samples": 8})
    shutil.copytree(Stage(base_cfg, 1).dir, Stage(cfg, 1).dir)  # same prompts and answers
    for script in ("02_extract_hidden_states.py", "03_build_vocab_map.py"):
        out = run(script, cfg)
        assert out.returncode == 0, out.stderr[-3000:]
    return cfg


def test_a_base_trained_on_shifted_ids_is_recognised(base, tmp_path, tiny_verifier):
    base_cfg, base_dir = base
    cfg = finetune_run(tmp_path, tiny_verifier, base_cfg, base_dir, aux=[1, 2, 3])
    measure = Stage(cfg, 2).dir / "measure"
    assert json.loads((measure / "index.json").read_text())["aux_layer_ids"] == [1, 2, 3, 4]
    msg = one_line_error(run("04_train.py", cfg))
    assert "read measured best: plus_one" in msg
    assert "set verifier.aux_layer_ids=[2, 3, 4]" in msg
    result = json.loads((Stage(cfg, 4).dir / "base_aux_measurement.json").read_text())
    scores = result["scores"]
    assert result["chosen"] == "plus_one" and set(scores) == {"as_is", "plus_one"}
    assert scores["plus_one"]["aux_layer_ids"] == [2, 3, 4]
    # Adjacent layers of a residual stream are alike, so the margin is modest but clear.
    assert scores["plus_one"]["full_acc"][0] > scores["as_is"]["full_acc"][0] + 0.05, scores


def test_the_measured_reading_fine_tunes(base, tmp_path, tiny_verifier):
    base_cfg, base_dir = base
    cfg = finetune_run(tmp_path, tiny_verifier, base_cfg, base_dir, aux=[2, 3, 4])
    out = run("04_train.py", cfg)
    assert out.returncode == 0, out.stderr[-3000:]
    info = Stage(cfg, 4).manifest()["finetune_from"]
    assert info["aux_convention"] == "measured best: plus_one"
    assert info["aux_layer_ids"] == [2, 3, 4] and info["aux_layer_ids_as_written"] == [1, 2, 3]


def test_two_ranks_measure_once_across_a_kill_and_resume(base, tmp_path, tiny_verifier):
    """The measurement is split over the ranks (every rank gets the same scores), cached in the
    run keyed by the base and the measure set, and reused when the run resumes after kill -9."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO
    from test_train_resume import torchrun, wait_for

    base_cfg, base_dir = base
    cfg = finetune_run(tmp_path, tiny_verifier, base_cfg, base_dir, aux=[2, 3, 4])
    args = ("train.epochs=8", "train.checkpoint_every=2", "train.measure_max_tokens=40")
    log = tmp_path / "first.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                             "2", "--master_port", "29577", "04_train.py", cfg.source, *args],
                            cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_for(Stage(cfg, 4).dir / "step-2", proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", cfg.source])
    proc.wait()
    first = log.read_text()
    assert first.count("measuring which layers the base's aux ids") == 1, first[-3000:]
    assert "2 rank(s)" in first and "<= 40 tokens each" in first
    out = torchrun(cfg, *args, port=29587)
    second = out.stdout + out.stderr
    assert "resumed from step-" in second, second[-3000:]
    assert "measuring which layers" not in second and "reusing the measurement" in second
    info = Stage(cfg, 4).manifest()["finetune_from"]
    assert info["aux_convention"] == "measured best: plus_one"
    # the cache key names what the scores depend on: the cap and the measure set among them
    key = json.loads((Stage(cfg, 4).dir / "base_aux_measurement.json").read_text())["key"]
    assert key["max_tokens"] == 40 and key["measure_set"]
