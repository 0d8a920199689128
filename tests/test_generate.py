"""Stage 01 on the tiny random verifier: outputs, masks, and resume after SIGKILL.

    .venv/bin/pytest tests/test_generate.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, make_config
from eagle3.data import load_tokenizer, tokenize_conversation
from eagle3.generate import run_generate
from eagle3.runs import Stage


def _dataset_dict(stage_dir):
    from datasets import load_from_disk
    return load_from_disk(str(stage_dir / "dataset")).to_dict()


def test_generate_outputs(tiny_config):
    stage = Stage(tiny_config, 1)
    run_generate(stage)
    out = stage.dir
    assert stage.is_done()
    ds = _dataset_dict(out)
    assert set(ds) == {"id", "input_ids", "loss_mask"}
    convs = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert len(convs) + len(errors) == 8 and len(ds["id"]) == len(convs)
    assert ds["id"] == [c["id"] for c in convs]
    assert sorted(p.name for p in (out / "chunks").iterdir()) == [
        "chunk-00000.jsonl", "chunk-00001.jsonl"]
    tok = load_tokenizer(tiny_config)
    for conv, ids, mask in zip(convs, ds["input_ids"], ds["loss_mask"]):
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
        assert conv["finish_reason"] in ("stop", "length")
        assert conv["sampling"]["temperature"] == 0.0
        assert 0 < conv["num_generated_tokens"] <= 16
        expected = tokenize_conversation(tok, conv["messages"], tiny_config.data.max_seq_len)
        assert (ids, mask) == expected
        # The mask covers the answer plus <|im_end|>, and nothing of the prompt.
        first = mask.index(1)
        assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
        assert conv["messages"][0]["content"] in tok.decode(ids[:first])
        assert all(mask[first:first + sum(mask)])
        if sum(mask) < len(ids) - first:  # not truncated: the turn closes with <|im_end|>
            assert ids[first + sum(mask) - 1] == tok.convert_tokens_to_ids("<|im_end|>")
    manifest = stage.manifest()
    assert manifest["counts"]["rows"] == len(convs)
    assert 0 < manifest["counts"]["assistant_fraction"] < 1


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, tiny_verifier):
    gen = {"max_new_tokens": 48, "batch_size": 1, "chunk_size": 1}
    (tmp_path / "killed").mkdir()
    (tmp_path / "clean").mkdir()
    killed_cfg = make_config(tmp_path / "killed", tiny_verifier, generate=gen)
    clean_cfg = make_config(tmp_path / "clean", tiny_verifier, generate=gen)
    killed, clean = Stage(killed_cfg, 1), Stage(clean_cfg, 1)

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(REPO / "01_generate_data.py"),
                             killed_cfg.source], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chunks = killed.dir / "chunks"
    deadline = time.time() + 120
    while not (chunks.is_dir() and any(p.name.startswith("chunk-") for p in chunks.iterdir())):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("stage 01 ended or hung before writing its first chunk")
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    # Nothing incomplete looks complete: no manifest, no merged outputs, and every chunk under
    # its final name is whole.
    assert not killed.is_done()
    for name in ("conversations.jsonl", "errors.jsonl", "dataset"):
        assert not (killed.dir / name).exists()
    finals = sorted(p for p in chunks.iterdir() if p.name.startswith("chunk-"))
    assert 1 <= len(finals) < 8
    for p in finals:
        rows = [json.loads(line) for line in p.read_text().splitlines()]
        assert len(rows) == 1 and p.read_text().endswith("\n")

    run_generate(killed)
    run_generate(clean)
    assert killed.is_done() and not any(p.name.startswith(".") for p in chunks.iterdir())
    assert _dataset_dict(killed.dir) == _dataset_dict(clean.dir)
    for name in ("conversations.jsonl", "errors.jsonl"):
        assert (killed.dir / name).read_bytes() == (clean.dir / name).read_bytes()


def test_sampled_generation_is_seeded(tmp_path, tiny_verifier):
    gen = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        cfg = make_config(tmp_path / name, tiny_verifier, data={"num_samples": 4},
                          generate=gen)
        run_generate(Stage(cfg, 1))
        runs.append((Stage(cfg, 1).dir / "conversations.jsonl").read_text())
    assert runs[0] == runs[1]
    row = json.loads(runs[0].splitlines()[0])
    assert row["sampling"] == {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 16,
                               "seed": 5}
