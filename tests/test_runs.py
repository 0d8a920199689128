"""Run directory contract: atomic writes survive SIGKILL, manifests gate stages, --restart."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import make_config
from eagle3.runs import (Stage, StageError, atomic_dir, atomic_write_bytes, atomic_write_json,
                         clean_stale_tmp)

WRITER = """
import sys, time
from pathlib import Path
from eagle3.runs import atomic_path
out = Path(sys.argv[1])
with atomic_path(out) as tmp:
    with open(tmp, "wb") as f:
        for i in range(10_000):
            f.write(b"x" * 100_000)
            f.flush()
            if i == 3:
                Path(sys.argv[2]).touch()   # tell the test we are mid-write
                time.sleep(30)
"""


def test_sigkill_mid_write_leaves_no_complete_looking_file(tmp_path):
    out, flag = tmp_path / "big.bin", tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(flag)],
                            cwd=Path(__file__).resolve().parents[1])
    deadline = time.time() + 60
    while not flag.exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".big.bin.tmp-")]
    assert leftovers, "the partial write went to a hidden temporary name"
    clean_stale_tmp(tmp_path)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_atomic_write_and_dir(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert (tmp_path / "a.json").read_text().strip().startswith("{")
    atomic_write_bytes(tmp_path / "a.json", b"{}")
    assert (tmp_path / "a.json").read_bytes() == b"{}"
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "d") as d:
            (d / "f").write_text("half")
            raise RuntimeError("crash")
    assert not (tmp_path / "d").exists()
    with atomic_dir(tmp_path / "d") as d:
        (d / "f").write_text("whole")
    assert (tmp_path / "d" / "f").read_text() == "whole"


def test_upstream_checks_and_restart(tmp_path, tiny_verifier):
    cfg = make_config(tmp_path, tiny_verifier)
    s1, s2 = Stage(cfg, 1), Stage(cfg, 2)
    with pytest.raises(StageError, match=r"run `python 01_generate_data.py .*` first"):
        s2.require(1)
    s1.dir.mkdir(parents=True)
    s1.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())
    assert s2.require(1)["stage"] == "01_data"
    assert s1.check_done()

    # A config that changes stage-01 data is incompatible, for 01 itself and for 02.
    other = replace(cfg, data=replace(cfg.data, num_samples=99))
    with pytest.raises(StageError, match="01_data was made with another config .*num_samples"):
        Stage(other, 2).require(1)
    with pytest.raises(StageError, match="add --restart"):
        Stage(other, 1).check_done()
    # A change that only concerns later stages is compatible.
    later = replace(cfg, train=replace(cfg.train, lr=0.5))
    Stage(later, 2).require(1)

    moved = Stage(other, 1).restart()
    assert moved.exists() and (moved / "manifest.json").exists()
    assert not s1.dir.exists()


def test_a_setting_added_since_keeps_old_outputs_valid_at_its_default():
    """An output recorded before `train.lk_eta` existed was made with its default: no change;
    any other value is one, named as absent there."""
    from eagle3.runs import config_changes

    recorded = {"train": {"lr": 1e-3}}
    assert config_changes(recorded, {"train": {"lr": 1e-3, "lk_eta": 3.0, "loss": "kl"}}) == []
    assert config_changes(recorded, {"train": {"lr": 1e-3, "loss": "lk_lambda"}}) == [
        "train.loss: absent there, 'lk_lambda' now"]
    assert config_changes({"train": {"lr": 1e-3, "loss": "kl"}}, {"train": {"lr": 1e-3}}) == [
        "train.loss: 'kl' there, absent now"]


def test_small_files_are_hashed_even_when_only_sizes_are_checked(tmp_path):
    from eagle3.runs import file_records, verify_files
    (tmp_path / "vocab.safetensors").write_bytes(bytes(range(256)) * 4)
    records = file_records(tmp_path, [tmp_path / "vocab.safetensors"])
    flipped = bytearray((tmp_path / "vocab.safetensors").read_bytes())
    flipped[100] ^= 1  # same size: a d2t entry off by one
    (tmp_path / "vocab.safetensors").write_bytes(bytes(flipped))
    assert "sha256 mismatch" in verify_files(tmp_path, records, "size")[0]
