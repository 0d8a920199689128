"""Stage 02 data parallelism: 2 ranks (gloo, CPU) write the same shards as 1 process.

    .venv/bin/pytest tests/test_hidden_states_dist.py -q
"""

import dataclasses
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_config
from test_hidden_states import _stage01


def _worker(rank: int, world: int, port: int, source: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # One thread per process in both runs, so float reductions happen in the same order.
    torch.set_num_threads(1)
    from eagle3 import dist
    from eagle3.config import load_config
    from eagle3.hidden_states import run_extract
    from eagle3.runs import Stage

    run_extract(Stage(load_config(source), 2))
    dist.destroy()


def _run(cfg, world: int) -> None:
    from eagle3.engines import free_port

    mp.start_processes(_worker, args=(world, free_port(), cfg.source), nprocs=world,
                       start_method="spawn", join=True)


# Three spawned interpreters (about a minute on 2 shared cores): run with the slow tests.
@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, tiny_verifier):
    from eagle3.runs import Stage

    hs = {"shard_samples": 2, "dtype": "bfloat16", "batch_tokens": 40}
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
    one = make_config(tmp_path / "one", tiny_verifier, hidden_states=hs)
    two = make_config(tmp_path / "two", tiny_verifier, hidden_states=hs)
    for cfg in (one, two):
        _stage01(cfg)
    _run(one, 1)
    _run(two, 2)
    a, b = Stage(one, 2), Stage(two, 2)
    assert a.is_done() and b.is_done()
    assert b.manifest()["counts"]["ranks"] == 2
    index = json.loads((a.dir / "index.json").read_text())
    assert len(index["shards"]) == 4
    assert index == json.loads((b.dir / "index.json").read_text())
    names = sorted(p.name for p in a.dir.glob("shard-*"))
    assert names == sorted(p.name for p in b.dir.glob("shard-*")) and len(names) == 8
    for name in names:
        assert (a.dir / name).read_bytes() == (b.dir / name).read_bytes(), name
    assert dataclasses.asdict(one.hidden_states) == dataclasses.asdict(two.hidden_states)
