"""Streamed hidden states (hidden_states.mode=stream): the same training as stored states, bit for
bit, a kill -9 resume, the producer's bound, the reference check, and the engine producer against
the vLLM stand-in of tests/test_hidden_states.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO, make_config, run_stage
from eagle3.checkpoint import step_dirs
from eagle3.runs import Stage
from eagle3.stream import Producer
from test_hidden_states import _FakeVllm

SMALL = {"data": {"num_samples": 12, "max_user_turns": 1, "max_seq_len": 96},
         # One sample per verifier forward in both modes: the capture batches agree, so the
         # states agree bit for bit (a forward's numerics depend on what it is batched with).
         "hidden_states": {"batch_tokens": 1, "stream_ahead": 2},
         "train": {"epochs": 4, "batch_tokens": 96, "checkpoint_every": 2, "keep": 2,
                   "ttt_steps": 3}}


def with_settings(cfg, dest: Path, **sections):
    """A copy of `cfg`'s run (stages 01 and 03 only) under `dest`, its config updated."""
    from eagle3.config import config_from_dict

    shutil.copytree(cfg.run_dir, dest / "runs" / cfg.run.name,
                    ignore=shutil.ignore_patterns("02_*", "04_*"))
    raw = yaml.safe_load(Path(cfg.source).read_text())
    raw["run"]["dir"] = str(dest / "runs")
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    (dest / "config.yaml").write_text(yaml.safe_dump(raw))
    return config_from_dict(raw, source=str(dest / "config.yaml"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_verifier):
    """Stages 01 and 03 on the tiny verifier, shared by the module's runs."""
    cfg = make_config(tmp_path_factory.mktemp("stream"), tiny_verifier, **SMALL)
    for script in ("01_generate_data.py", "03_build_vocab_map.py"):
        run_stage(script, cfg)
    return cfg


@pytest.fixture(scope="module")
def stored(base, tmp_path_factory):
    cfg = with_settings(base, tmp_path_factory.mktemp("stored"))
    run_stage("02_extract_hidden_states.py", cfg)
    run_stage("04_train.py", cfg)
    return cfg


def final_weights(cfg):
    return load_file(step_dirs(Stage(cfg, 4).dir)[-1][1] / "model.safetensors")


def assert_same_training(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert (Stage(a, 4).dir / "metrics.jsonl").read_text() == \
        (Stage(b, 4).dir / "metrics.jsonl").read_text()


def test_stream_stores_only_the_reference_and_trains_bit_identically(stored, base, tmp_path):
    cfg = with_settings(base, tmp_path, hidden_states={"mode": "stream"})
    out = run_stage("02_extract_hidden_states.py", cfg)
    hs = Stage(cfg, 2)
    manifest = hs.manifest()
    assert manifest["mode"] == "stream" and manifest["counts"]["shards"] == 0
    assert not list(hs.dir.glob("shard-*")), "stream mode stores no data set"
    stored_bytes = Stage(stored, 2).manifest()["counts"]["bytes"]
    assert manifest["counts"]["bytes_if_stored"] >= stored_bytes * 0.9
    assert manifest["counts"]["bytes"] < stored_bytes / 2
    assert "computed while stage 04 trains" in out.stderr + out.stdout

    train = run_stage("04_train.py", cfg)
    assert "reproduced bit for bit" in train.stderr + train.stdout
    assert_same_training(stored, cfg)
    flow = [json.loads(x) for x in (Stage(cfg, 4).dir / "data_flow.jsonl").read_text().split("\n")
            if x]
    assert [r["epoch"] for r in flow] == [0, 1, 2, 3]
    assert all(r["mode"] == "stream" and 0 <= r["wait_fraction"] <= 1 for r in flow)
    assert all(r["buffer_max"] <= r["buffer_bound"] == 2 for r in flow)
    assert all(r["producer_tokens_per_s"] > 0 and r["trainer_tokens_per_s"] > 0 for r in flow)
    m = Stage(cfg, 4).manifest()
    assert m["hidden_states_mode"] == "stream" and len(m["data_flow"]) == 4


def test_streamed_run_with_a_cache_killed_then_resumed_equals_the_stored_run(stored, base,
                                                                             tmp_path):
    """Half the data's states kept on disk (hidden_states.cache_gb), the rest streamed; kill -9
    mid-run and resume: the stored run's weights and metrics, bit for bit."""
    budget = Stage(stored, 2).manifest()["counts"]["bytes"] / 2
    cfg = with_settings(base, tmp_path, hidden_states={"mode": "stream",
                                                       "cache_gb": budget / 1e9})
    run_stage("02_extract_hidden_states.py", cfg)
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "04_train.py", cfg.source], cwd=REPO,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    from test_train_resume import wait_for
    wait_for(Stage(cfg, 4).dir / "step-2", proc, log)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not Stage(cfg, 4).is_done()
    out = run_stage("04_train.py", cfg)
    assert "resumed from step-" in out.stdout + out.stderr
    assert_same_training(stored, cfg)
    cache = Stage(cfg, 4).dir / "state_cache"
    files = list(cache.glob("*.safetensors"))
    assert files and sum(f.stat().st_size for f in files) <= budget
    flow = Stage(cfg, 4).manifest()["data_flow"]
    # after the first epoch the cache serves its samples: the verifier computes the rest
    assert flow[-1]["cache_read_tokens"] > 0 and flow[-1]["verifier_tokens"] > 0
    assert all(r["cache_bytes"] <= budget for r in flow)


def test_producer_holds_at_most_its_bound():
    fetched = []

    def fetch(group):
        fetched.append(tuple(group))
        return [{"input_ids": torch.zeros(len(group))}]

    p = Producer(fetch, depth=3)
    groups = [[i] for i in range(10)]
    for step in range(10):
        p.ahead(groups[step:])
        assert len(p.pending) <= 3
        assert p.take(groups[step]) is not None
    assert p.max_pending == 3 and fetched == [tuple(g) for g in groups]
    assert p.take([99]) is None  # never queued: the caller fetches it itself
    w = p.window()
    assert w["producer_tokens"] == 10 and w["waited_s"] >= 0
    p.close()


def test_changed_verifier_is_caught_before_training(tmp_path, tiny_verifier):
    from eagle3.runs import StageError
    from safetensors.torch import save_file

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier, verifier)
    cfg = make_config(tmp_path, verifier, data={"num_samples": 4, "max_user_turns": 1,
                                                "max_seq_len": 64},
                      hidden_states={"mode": "stream"})
    for script in ("01_generate_data.py", "02_extract_hidden_states.py",
                   "03_build_vocab_map.py"):
        run_stage(script, cfg)
    weights = load_file(verifier / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] * 1.5
    save_file(weights, str(verifier / "model.safetensors"), metadata={"format": "pt"})
    out = run_stage("04_train.py", cfg, check=False)
    assert out.returncode != 0
    assert "differ from stage 02's reference" in out.stderr
    assert not Stage(cfg, 4).dir.joinpath("step-1").exists()


def test_engine_producer_streams_what_the_engine_stores(base, tmp_path, tiny_verifier):
    """The vllm backend in both modes, against the vLLM stand-in (one forward per request, so its
    states do not depend on batching): the streamed run equals the stored one bit for bit, and
    every file the engine wrote was consumed."""
    storage = tmp_path / "vllm_storage"
    storage.mkdir()
    fake, other = (_FakeVllm(tiny_verifier, [1, 2, 3, 4], storage) for _ in range(2))
    try:
        engine = {"backend": "vllm", "server_urls": [fake.url, other.url], "concurrency": 3}
        runs = []
        for mode in ("store", "stream"):
            cfg = with_settings(base, tmp_path / mode, hidden_states={**engine, "mode": mode},
                                train={"epochs": 2})
            run_stage("02_extract_hidden_states.py", cfg)
            run_stage("04_train.py", cfg)
            runs.append(cfg)
        assert_same_training(*runs)
        assert not any(storage.iterdir())
        # both servers answered; stage 02 sends each sample once, streaming once per epoch
        assert fake.requests and other.requests
        assert len(fake.requests) + len(other.requests) >= 12 + 2 * 9
    finally:
        fake.close()
        other.close()


def test_each_rank_streams_from_its_own_servers():
    from eagle3.dist import DistContext
    from eagle3.hidden_states import rank_servers

    urls = [f"http://n{i}:8000" for i in range(4)]
    ctx = lambda rank, world: DistContext(rank, world, rank, world, torch.device("cpu"))  # noqa
    assert rank_servers(urls, ctx(0, 1)) == urls  # stage 02: all of them
    assert [rank_servers(urls, ctx(r, 2)) for r in range(2)] == [urls[0::2], urls[1::2]]
    assert [rank_servers(urls[:2], ctx(r, 4)) for r in range(4)] == \
        [[urls[0]], [urls[1]], [urls[0]], [urls[1]]]


def test_two_ranks_streaming_train_as_two_ranks_reading_stored_states(base, tmp_path):
    """Under torchrun each rank runs its own in-process producer for exactly the micro-batches
    it trains on: the weights equal those of the same two ranks reading stage 02's shards."""
    from test_train_resume import torchrun

    runs = {}
    for mode, port in (("store", 29577), ("stream", 29587)):
        cfg = with_settings(base, tmp_path / mode, hidden_states={"mode": mode})
        run_stage("02_extract_hidden_states.py", cfg)
        out = torchrun(cfg, "train.max_steps=6", "train.parallel=ddp", port=port)
        assert Stage(cfg, 4).manifest()["counts"]["world_size"] == 2
        runs[mode] = (cfg, out.stdout + out.stderr)
    assert_same_training(runs["store"][0], runs["stream"][0])
    flow = Stage(runs["stream"][0], 4).manifest()["data_flow"]
    assert flow and all(r["verifier_tokens"] > 0 for r in flow), flow
