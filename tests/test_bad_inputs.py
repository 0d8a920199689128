"""Bad input and hostile use, through the stage scripts as a user runs them: each case ends in
one line naming the file and the fix (exit code 2, no traceback), and damages nothing that
was already produced (docs/errors.md is the table of these messages).

    .venv/bin/pytest tests/test_bad_inputs.py -q
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_config, run_stage
from eagle3.runs import Stage, atomic_write_json, depends_on, file_records

UPSTREAM = ["01_generate_data.py", "02_extract_hidden_states.py", "03_build_vocab_map.py"]


def run(script, cfg, *extra, env=None, cwd=REPO):
    return run_stage(script, cfg, *extra, env=env, cwd=cwd)


def one_line_error(out) -> str:
    """The stage failed with exactly one `error:` line on stderr and no traceback."""
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier):
    """Stages 01-03 on the tiny verifier (12 short samples, 4 shards)."""
    tmp = tmp_path_factory.mktemp("bad")
    cfg = make_config(tmp, tiny_verifier,
                      data={"num_samples": 12, "max_user_turns": 1, "max_seq_len": 96},
                      train={"epochs": 4, "batch_tokens": 96, "checkpoint_every": 2,
                             "ttt_steps": 2})
    for script in UPSTREAM:
        out = run(script, cfg)
        assert out.returncode == 0, out.stderr[-3000:]
    return cfg


def copy_run(cfg, dest: Path, verifier: Path = None):
    """A second run directory with the same finished stages (and a config pointing at it)."""
    import yaml
    shutil.copytree(cfg.run_dir, dest / "runs" / cfg.run.name, ignore=shutil.ignore_patterns(
        "04_train*", ".locks"))
    raw = yaml.safe_load(Path(cfg.source).read_text())
    raw["run"]["dir"] = str(dest / "runs")
    if verifier is not None:
        raw["verifier"]["path"] = str(verifier)
    (dest / "config.yaml").write_text(yaml.safe_dump(raw))
    from eagle3.config import load_config
    return load_config(dest / "config.yaml")


# ---------------------------------------------------------------------------------------------
# The six cases that ended badly


def test_damage_after_completion_is_named_and_repaired(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    shard = Stage(cfg, 2).dir / "shard-00001.safetensors"
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x55  # same size: only the hash sees it
    shard.write_bytes(bytes(damaged))

    msg = one_line_error(run("02_extract_hidden_states.py", cfg))
    assert "02_hidden_states is complete but damaged" in msg and "shard-00001" in msg
    assert "--repair" in msg
    msg = one_line_error(run("04_train.py", cfg))
    assert "02_hidden_states is damaged" in msg and "shard-00001.safetensors" in msg
    assert "02_extract_hidden_states.py" in msg and "--repair" in msg
    assert not Stage(cfg, 4).dir.exists()

    out = run("02_extract_hidden_states.py", cfg, "--repair")
    assert out.returncode == 0, out.stderr[-2000:]
    assert shard.read_bytes() == original
    assert Stage(cfg, 2).manifest()["counts"]["bytes_written_this_run"] == len(original)
    assert run("02_extract_hidden_states.py", cfg).returncode == 0  # complete again


def test_non_finite_states_stop_training_naming_samples(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    for shard in sorted(Stage(cfg, 2).dir.glob("shard-*.safetensors")):
        header = json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8],
                                                                       "little")])
        start, end = header["aux"]["data_offsets"]
        base = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        data = bytearray(shard.read_bytes())
        data[base + start:base + start + 64] = b"\xff" * 64  # float32 NaNs, same size
        shard.write_bytes(bytes(data))
    # Non-finite states that stage 02 itself wrote (a verifier gone NaN) pass every integrity
    # check: training itself must stop.
    s2 = Stage(cfg, 2)
    manifest = s2.manifest()
    manifest["files"] = file_records(s2.dir, [s2.dir / name for name in manifest["files"]])
    atomic_write_json(s2.manifest_path, manifest)
    msg = one_line_error(run("04_train.py", cfg))
    assert "non-finite loss at step 1" in msg
    assert "samples with non-finite hidden states" in msg and "shard-0000" in msg
    assert "last good checkpoint: none" in msg and "--repair" in msg
    assert not list(Stage(cfg, 4).dir.glob("step-*"))


def test_answers_cut_by_batch_tokens_are_refused_at_start(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    msg = one_line_error(run("04_train.py", cfg, "train.batch_tokens=16"))
    assert "have supervised tokens beyond train.batch_tokens=16" in msg
    assert "set train.batch_tokens >=" in msg


def test_a_second_run_of_a_stage_and_a_redo_of_its_upstream_are_refused(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    log = open(tmp_path / "first.log", "w")
    long = ["train.epochs=400", "train.max_steps=300"]
    first = subprocess.Popen([sys.executable, "04_train.py", cfg.source, *long],
                             cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not list(Stage(cfg, 4).dir.glob("step-*")):
            assert first.poll() is None and time.time() < deadline, \
                (tmp_path / "first.log").read_text()
            time.sleep(0.2)
        msg = one_line_error(run("04_train.py", cfg, *long))
        assert "04_train is already being run by another process (pid" in msg
        msg = one_line_error(run("02_extract_hidden_states.py", cfg, "--restart"))
        assert "02_hidden_states is being read by a running 04_train" in msg
        assert Stage(cfg, 2).is_done()  # nothing was moved aside
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    # The OS dropped the killed process's locks: the run resumes at once.
    out = run("04_train.py", cfg, *long)
    assert out.returncode == 0 and "resumed from step-" in out.stdout, out.stderr[-2000:]


# (The JSON array cut at a syntax error: tests/test_data.py; the server that never answers:
# tests/test_generate_servers.py.)


# ---------------------------------------------------------------------------------------------
# Poor messages that are now one line


@pytest.fixture
def broken_verifier(tmp_path, tiny_verifier):
    dest = tmp_path / "verifier"
    shutil.copytree(tiny_verifier, dest)
    return dest


def test_truncated_verifier_weights(prepared, tmp_path, broken_verifier):
    weights = broken_verifier / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    cfg = copy_run(prepared, tmp_path, verifier=broken_verifier)
    msg = one_line_error(run("02_extract_hidden_states.py", cfg, "--restart"))
    assert f"verifier weights {weights} are" in msg and "truncated or damaged" in msg
    assert Stage(cfg, 2).is_done()  # --restart checked the verifier before moving anything


def test_corrupt_verifier_config(prepared, tmp_path, broken_verifier):
    (broken_verifier / "config.json").write_text("{ not json")
    cfg = copy_run(prepared, tmp_path, verifier=broken_verifier)
    msg = one_line_error(run("03_build_vocab_map.py", cfg))
    assert "config.json is not valid JSON" in msg and "restore" in msg


def test_missing_tokenizer(tmp_path, broken_verifier):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken_verifier / name).unlink()
    cfg = make_config(tmp_path, broken_verifier, data={"num_samples": 2})
    msg = one_line_error(run("01_generate_data.py", cfg))
    assert f"verifier tokenizer in {broken_verifier} cannot be loaded" in msg
    assert "huggingface.co" not in msg


def test_missing_weights_file(prepared, tmp_path, broken_verifier):
    (broken_verifier / "model.safetensors").unlink()
    cfg = copy_run(prepared, tmp_path, verifier=broken_verifier)
    msg = one_line_error(run("04_train.py", cfg))
    assert "has no model.safetensors or model.safetensors.index.json" in msg


def test_truncated_vocab_map(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    vocab = Stage(cfg, 3).dir / "vocab.safetensors"
    vocab.write_bytes(vocab.read_bytes()[:100])
    msg = one_line_error(run("04_train.py", cfg))
    assert "03_vocab is damaged" in msg and "vocab.safetensors" in msg
    assert "03_build_vocab_map.py" in msg and "--repair" in msg


def test_truncated_trainer_state_resumes_from_the_previous_checkpoint(prepared, tmp_path):
    a, b = copy_run(prepared, tmp_path / "a"), copy_run(prepared, tmp_path / "b")
    for cfg in (a, b):
        assert run("04_train.py", cfg, "train.max_steps=4").returncode == 0
    train = Stage(b, 4).dir
    (train / "manifest.json").unlink()
    state = train / "step-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:len(state.read_bytes()) // 2])
    out = run("04_train.py", b, "train.max_steps=4")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "checkpoint step-4 is damaged" in out.stdout and "resumed from step-2" in out.stdout
    assert list(train.glob("step-4.damaged-*"))  # moved aside, never deleted
    wa = load_file(Stage(a, 4).dir / "step-4" / "model.safetensors")
    wb = load_file(train / "step-4" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_disk_full_says_so_and_what_is_needed(prepared, tmp_path, monkeypatch, capsys):
    from eagle3 import hidden_states, shards
    from eagle3.cli import stage_main

    cfg = copy_run(prepared, tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("safetensors.torch.save_file", full)
    rc = stage_main(2, hidden_states.run_extract, "x", argv=[cfg.source, "--restart"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: disk full while writing" in err
    assert "GB free; this stage still needed about" in err and "Traceback" not in err
    assert shards  # the writer that hit the full disk


def test_config_changes_name_the_key(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    msg = one_line_error(run("03_build_vocab_map.py", cfg, "vocab.draft_vocab_size=256"))
    assert "03_vocab already exists with another config (vocab.draft_vocab_size: 512 there, " \
           "256 now)" in msg and "--restart" in msg
    msg = one_line_error(run("04_train.py", cfg, "data.num_samples=13"))
    assert "01_data was made with another config (data.num_samples: 12 there, 13 " \
           "now)" in msg
    # A cosmetic key changes nothing downstream.
    assert run("03_build_vocab_map.py", cfg, "train.log_every=7").returncode == 0


def test_a_stage_made_with_an_override_names_it(prepared, tmp_path):
    """The fine-tune flow's loop: an upstream made with a command-line override, a later stage
    run without it; the message gives the override that reproduces the upstream."""
    cfg = copy_run(prepared, tmp_path)
    assert run("03_build_vocab_map.py", cfg, "--restart", "vocab.draft_vocab_size=256"
               ).returncode == 0
    msg = one_line_error(run("04_train.py", cfg))
    assert "03_vocab was made with another config (vocab.draft_vocab_size: 256 there, 512 " \
           "now)" in msg and "add the override(s) it was made with: " \
           "vocab.draft_vocab_size=256" in msg


def test_every_stage_takes_finetune_from():
    """Every stage script parses its command line with `cli._parse` (through `stage_main`),
    which takes the common flags whatever the stage's own."""
    from eagle3.cli import _parse
    _, overrides = _parse("x", ["c.yaml", "--finetune-from", "/base"], {})
    assert overrides == ["train.finetune_from=/base"]


def test_run_pipeline_trains_under_torchrun_with_one_process_per_gpu(prepared, tmp_path):
    """Stage 04 of the pipeline runs as the runbook's torchrun does (here two ranks asked for
    with NPROC_PER_NODE, on an empty run: both ranks stop at the missing upstream)."""
    cfg = copy_run(prepared, tmp_path)
    shutil.rmtree(cfg.run_dir)
    out = subprocess.run(["bash", str(REPO / "run_pipeline.sh"), cfg.source, "4"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"})
    assert "=== stage 4: torchrun --nproc_per_node 2 04_train.py ===" in out.stdout
    assert out.returncode != 0 and "02_hidden_states is not complete" in out.stderr


def test_a_value_equal_to_the_derived_default_is_the_same_config(tmp_path, smollm2):
    derived = make_config(tmp_path, smollm2, verifier={"aux_layer_ids": None})
    explicit = make_config(tmp_path, smollm2, verifier={"aux_layer_ids": [2, 15, 27]})
    assert depends_on(derived, 4) == depends_on(explicit, 4)


def test_restart_checks_before_moving_anything(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    train = Stage(cfg, 4).dir
    train.mkdir(parents=True)
    (train / "marker").write_text("kept")
    shadow = tmp_path / "shadow" / "tensorboard"  # tensorboard missing
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('tensorboard is not installed')\n")
    msg = one_line_error(run("04_train.py", cfg, "--restart", "train.tensorboard=true",
                             env={"PYTHONPATH": str(shadow.parent)}))
    assert "pip install tensorboard" in msg
    assert (train / "marker").read_text() == "kept"  # nothing was moved aside


def test_run_pipeline_reads_a_relative_config_and_checks_from_stage(prepared, tmp_path):
    cfg = copy_run(prepared, tmp_path)
    script = str(REPO / "run_pipeline.sh")
    out = subprocess.run(["bash", script, "config.yaml", "7"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "FROM_STAGE must be a stage number 1-6, got '7'" in out.stderr
    out = subprocess.run(["bash", script, "config.yaml", "6"], cwd=tmp_path,
                         capture_output=True, text=True)
    # The config was found (relative to the caller) and stage 06 names its missing upstream.
    assert out.returncode == 2 and "05_export is not complete" in out.stderr, out.stderr
    assert cfg.source.endswith("config.yaml")


def test_training_on_cuda_without_a_gpu_stops_before_any_check(prepared, tmp_path):
    """`train.device=cuda` where torch sees no GPU (a CPU build of torch on a GPU node): one
    line before stage 04 reads anything, instead of a silent gloo run on the CPU."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run("04_train.py", prepared, "train.device=cuda")
    line = one_line_error(out)
    assert "train.device=cuda" in line and "sees no GPU" in line, line
    assert not (prepared.run_dir / "04_train").exists()


def test_cuda_preflight_counts_the_gpus_per_local_rank(monkeypatch):
    from eagle3 import dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dist.cuda_shortfall(4) is None
    assert "8 ranks on this node but torch sees 4 GPU(s)" in dist.cuda_shortfall(8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "sees no GPU" in dist.cuda_shortfall(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(dist.DeviceError, match="train.device=cuda, but"):
        dist.init("cuda")


def test_two_ranks_hash_the_upstream_files_split_between_them(prepared, tmp_path):
    """Under torchrun every rank hashes its share of stage 02's files (no rank idles in a
    barrier while rank 0 hashes them all): a bit flip in a file of rank 1's share stops the
    job with the same one line as a single process gives."""
    cfg = copy_run(prepared, tmp_path)
    records = sorted(Stage(cfg, 2).manifest()["files"])
    name = records[1]  # every second file is rank 1's
    path = Stage(cfg, 2).dir / name
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x55  # same size: only a hash sees it
    path.write_bytes(bytes(damaged))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                          "2", "--master_port", "29597", "04_train.py", cfg.source], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    lines = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert lines and all(x == lines[0] for x in lines), out.stderr[-3000:]
    assert "02_hidden_states is damaged" in lines[0] and name in lines[0], lines[0]
    assert not (Stage(cfg, 4).dir / "manifest.json").exists()


def test_a_full_disk_while_saving_a_checkpoint_is_named_as_one():
    from eagle3 import checkpoint
    from eagle3.cli import _is_disk_full
    with pytest.raises(OSError) as e:
        checkpoint.save_trainer_state({"x": torch.zeros(100_000)}, Path("/dev/full"))
    assert _is_disk_full(e.value)
