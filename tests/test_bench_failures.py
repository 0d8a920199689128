"""Stage 06 and the engine launcher when things go wrong: speculative cells that count no drafts,
SIGTERM while an engine runs, engines left running by a kill -9, engines killed by a signal
while starting, damaged saved cells. Stand-in engines only (seconds each).

    .venv/bin/pytest tests/test_bench_failures.py -q

The stand-ins are tests/test_bench.py's FAKE_SERVER (vLLM and SGLang wire formats) and, for the
process-group tests, GROUP_SERVER below: an engine that starts a worker in its own process
group, as vLLM and SGLang do, so that "the group is gone" is not the same as "the leader
exited".
"""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, make_config
from eagle3 import bench, engines
from eagle3.cli import stage_main
from eagle3.config import ServerConfig
from eagle3.runs import Stage, StageError
from test_bench import FAKE_SERVER, _bench_config, _export_stage, fake_python  # noqa: F401


def _fake_python_for(tmp_path: Path, name: str, source: str) -> str:
    """Like test_bench's `fake_python`, running `source` instead of FAKE_SERVER."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    exe = tmp_path / f"{name}-python"
    exe.write_text(f"#!/bin/sh\nmodule=$2\nshift 2\ncase $module in\n"
                   f"  sglang*) exec {sys.executable} {script} sglang \"$@\";;\n"
                   f"  *) exec {sys.executable} {script} vllm \"$@\";;\nesac\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def _vllm_only(tmp_path, tiny_verifier, python, **bench_cfg):
    server = {"python": python, "startup_timeout_s": 30.0,
              "env": {"FAKE_LOG": str(tmp_path / "starts.jsonl")}}
    return _bench_config(tmp_path, tiny_verifier, python,
                         engines=[{"name": "vllm", "depths": [1, 3], "server": server}],
                         **{"num_prompts": 3, "max_tokens": 12, "concurrency": [1], **bench_cfg})


# ---------------------------------------------------------------------------------------------
# 1. Speculative cells that count no drafts


def test_cells_without_speculative_counters_fail_after_all_cells_ran(tmp_path, tiny_verifier,
                                                                     capsys):
    """A vLLM whose /metrics has no counters under the names we read (renamed in another
    version, or speculation off): every speculative cell fails naming the metrics looked for,
    the stage ends with exit code 2 after the other cells ran, and no depth is called
    fastest."""
    renamed = _fake_python_for(tmp_path, "renamed", FAKE_SERVER.replace(
        "vllm:spec_decode_", "vllm:speculative_"))
    stage = _export_stage(_vllm_only(tmp_path, tiny_verifier, renamed))
    rc = stage_main(6, bench.run_bench, "x", argv=[stage.cfg.source])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(
        "error: 2 cell(s) measured no drafts: vllm-1_1_2-c1-mtbench-t0: no drafts measured: no "
        "speculative counters in /metrics (looked for vllm:spec_decode_num_drafts_total, "
        "vllm:spec_decode_num_draft_tokens_total, ")
    results = stage.dir / "results"
    cells = {p.stem: json.loads(p.read_text()) for p in results.glob("*.json")}
    assert set(cells) == {"vllm-baseline-c1-mtbench-t0", "vllm-1_1_2-c1-mtbench-t0",
                          "vllm-3_1_4-c1-mtbench-t0"}
    assert not cells["vllm-baseline-c1-mtbench-t0"].get("failed")
    assert cells["vllm-3_1_4-c1-mtbench-t0"]["failed"]
    assert cells["vllm-3_1_4-c1-mtbench-t0"]["alarm"]["kind"] == bench.NO_DRAFTS
    md = (stage.dir / "results.md").read_text()
    assert "- vllm, concurrency 1, mtbench, T=0: none (no depth measured acceptance)" in md
    assert not stage.is_done()


def _cell(engine="vllm", run="3/1/4", drafts=0, seen=(), length=None, tok_s=10.0):
    return {"cell": f"{engine}-{run.replace('/', '_')}-c4-mtbench-t0", "engine": engine,
            "run": run, "num_drafts": drafts, "num_requests": 8, "spec_metrics": list(seen),
            "concurrency": 4, "prompt_set": "mtbench", "temperature": 0.0,
            "mean_acceptance_length": length, "output_tok_s": tok_s, "speedup": 1.0}


def _stage(tmp_path, expect_trained=True):
    return SimpleNamespace(cfg=SimpleNamespace(bench=SimpleNamespace(
        expect_trained=expect_trained)), dir=tmp_path)


def test_no_drafts_names_what_it_saw(tmp_path):
    log = tmp_path / "none.log"
    present = bench.no_drafts(_stage(tmp_path), _cell(seen=[bench.DRAFTS]), log)
    assert present["failed"] and present["alarm"]["why"] == (
        "no drafts measured: vllm:spec_decode_num_drafts_total is in /metrics but counted 0 "
        "drafts over 8 requests: the server did not speculate")
    partial = bench.no_drafts(_stage(tmp_path), _cell(seen=[bench.ACCEPTED]), log)
    assert partial["alarm"]["why"] == (
        "no drafts measured: no vllm:spec_decode_num_drafts_total in /metrics (found only "
        "vllm:spec_decode_num_accepted_tokens_total): speculation is off, or this vllm names "
        "them otherwise")
    sglang = bench.no_drafts(_stage(tmp_path), _cell(engine="sglang"), log)
    assert "no speculative counters in /generate's meta_info (looked for spec_verify_ct, " \
           "spec_correct_drafts_histogram)" in sglang["alarm"]["why"]
    assert bench.no_drafts(_stage(tmp_path), _cell(run="baseline"), log) == {}
    assert bench.no_drafts(_stage(tmp_path), _cell(drafts=5, length=1.2), log) == {}
    # A drafter the config calls untrained: reported, not failed.
    assert bench.no_drafts(_stage(tmp_path, expect_trained=False), _cell(), log) == {}


def test_no_fastest_depth_from_cells_without_acceptance():
    rows = [_cell(run="3/1/4", tok_s=50.0), _cell(run="1/1/2", length=1.4, tok_s=20.0)]
    assert bench.best_depths(rows) == [
        "- vllm, concurrency 4, mtbench, T=0: **1/1/2** (1.00x, acceptance length 1.400)"]
    assert bench.best_depths(rows[:1]) == [
        "- vllm, concurrency 4, mtbench, T=0: none (no depth measured acceptance)"]


# ---------------------------------------------------------------------------------------------
# Process groups: SIGTERM, kill -9, signals at start-up

GROUP_SERVER = r"""
import os, signal, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if os.environ.get("IGNORE_SIGTERM"):  # a stuck engine
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen(["sleep", "600"])  # in the engine's process group, as engines' are
with open(os.environ["WORKER_PID"], "w") as f:
    f.write(str(worker.pid))


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

# A stage in miniature: starts one engine through engines.start_server, then waits.
STAGE = r"""
import sys, time
from pathlib import Path
from eagle3.config import ServerConfig, load_config
from eagle3.engines import start_server

cfg = load_config(sys.argv[1])
server = ServerConfig(command=[sys.executable, sys.argv[2], "--port", "{port}"],
                      env={"WORKER_PID": sys.argv[3], "IGNORE_SIGTERM": sys.argv[4]},
                      startup_timeout_s=60)
with start_server("vllm", cfg, server, "generate.server", Path(sys.argv[3] + ".log"),
                  max_model_len=64):
    print("serving", flush=True)
    time.sleep(600)
"""


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on; [] once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return []


def _group_of(pid: int) -> int:
    return int(_stat(pid)[2])


def _members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies have exited)."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if (s := _stat(pid)) and s[0] != "Z" and int(s[2]) == pgid]


def _wait_gone(pgid: int, seconds: float = 10.0) -> list[int]:
    deadline = time.time() + seconds
    while _members(pgid) and time.time() < deadline:
        time.sleep(0.1)
    return _members(pgid)


def _records(cfg) -> list[Path]:
    return list((cfg.run_dir / ".locks" / "engines").glob("*.json"))


@pytest.fixture
def small_stage(tmp_path, tiny_verifier):
    """Start STAGE in a subprocess; yields (process, engine process group); kills whatever is
    left of both at the end."""
    cfg = make_config(tmp_path, tiny_verifier)
    (tmp_path / "group_server.py").write_text(GROUP_SERVER)
    (tmp_path / "stage.py").write_text(STAGE)
    started = []

    def start(ignore_sigterm: bool = False, name: str = "w1"):
        worker_file = tmp_path / name
        proc = subprocess.Popen(
            [sys.executable, str(tmp_path / "stage.py"), cfg.source,
             str(tmp_path / "group_server.py"), str(worker_file), "1" if ignore_sigterm else ""],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "serving\n", proc.communicate()[1][-2000:]
        pgid = _group_of(int(worker_file.read_text()))
        started.append((proc, pgid))
        return proc, pgid

    yield cfg, start
    for proc, pgid in started:
        proc.kill()
        proc.communicate()
        for pid in _members(pgid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_engine_group_and_exits_143(small_stage):
    cfg, start = small_stage
    proc, pgid = start()
    assert len(_members(pgid)) == 2  # the engine and its worker
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    last = err.strip().splitlines()[-1]
    assert last == (f"error: stopped by SIGTERM after stopping the vllm server and its workers "
                    f"(process group {pgid}); rerun the stage to continue where it stopped "
                    f"(finished parts are kept)")
    assert _wait_gone(pgid, 2.0) == [], "the engine's worker outlived the SIGTERM"
    assert not _records(cfg)  # stopped cleanly: no record left


def test_sigterm_mid_cell_ends_stage_06_at_once_keeping_finished_cells(tmp_path, tiny_verifier):
    """Stage 06 as a user runs it, SIGTERM while a cell waits for a long answer (a minute
    here): the stage neither waits for it nor sends the queued prompts (Slurm allows 30 s
    before SIGKILL), the engine is stopped, the exit code is 143 with one line, the finished
    cells are kept."""
    slow = _fake_python_for(tmp_path, "slow", FAKE_SERVER.replace(  # at depth 3
        "    def do_POST(self):\n",
        "    def do_POST(self):\n        if steps == 3: __import__('time').sleep(60)\n"))
    cfg = _vllm_only(tmp_path, tiny_verifier, slow, num_prompts=6, concurrency=[1, 2])
    stage = _export_stage(cfg)
    proc = subprocess.Popen([sys.executable, "06_deploy_and_bench.py", cfg.source], cwd=REPO,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        healthy = 0
        while healthy < 3:  # the depth-3 server: the baseline's and depth 1's cells are saved
            line = proc.stdout.readline()
            assert line, proc.communicate()[1][-2000:]
            healthy += "vllm healthy after" in line
        time.sleep(1.0)
        kept = {p.name: p.stat().st_mtime_ns for p in (stage.dir / "results").glob("*.json")}
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.time() - sent < 10
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM after stopping the "
                                                   "vllm server and its workers (process group ")
    engine = [json.loads(x) for x in (tmp_path / "starts.jsonl").read_text().splitlines()][-1]
    assert _wait_gone(engine["pid"], 2.0) == []
    assert len(kept) == 4 and not stage.is_done()
    assert {p.name: p.stat().st_mtime_ns for p in (stage.dir / "results").glob("*.json")} == kept


@pytest.mark.parametrize("leader_ignores_sigterm", [False, True])
def test_next_start_stops_what_a_kill_9_left_running(small_stage, tmp_path, monkeypatch, caplog,
                                                     leader_ignores_sigterm):
    """The stage is killed with kill -9. Its engine gets SIGTERM from the kernel (PDEATHSIG)
    and exits, leaving its worker (False), or is stuck and ignores it (True). The next start
    of an engine by the same stage stops that group; the record file is what finds it."""
    cfg, start = small_stage
    proc, pgid = start(ignore_sigterm=leader_ignores_sigterm)
    proc.kill()
    proc.wait()
    time.sleep(0.5)  # the kernel's SIGTERM to the engine (PDEATHSIG) takes effect
    left = _members(pgid)
    assert left and (pgid in left) == leader_ignores_sigterm
    monkeypatch.setattr(engines, "ORPHAN_GRACE_S", 1.0, raising=False)
    server = ServerConfig(command=[sys.executable, str(tmp_path / "group_server.py"), "--port",
                                   "{port}"], env={"WORKER_PID": str(tmp_path / "w2")},
                          startup_timeout_s=60)
    with caplog.at_level("WARNING", logger="eagle3"):
        with engines.start_server("vllm", cfg, server, "generate.server", tmp_path / "2.log",
                                  max_model_len=64):
            assert _members(pgid) == []
    assert "stopping an engine that an earlier run of this stage left running: process group " \
           f"{pgid}" in caplog.text
    assert not _records(cfg)


def test_a_record_that_does_not_identify_its_processes_kills_nothing(tmp_path, tiny_verifier,
                                                                     caplog):
    """A pid alone proves nothing (the OS reuses them): a live process whose start time is not
    the recorded one is left alone, and the record is dropped."""
    cfg = make_config(tmp_path, tiny_verifier)
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        real = int(_stat(stranger.pid)[19])  # its start time
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        record = engines.EngineRecord(
            path=engines.records_dir(cfg) / f"generate-{stranger.pid}.json", pid=stranger.pid,
            command=["sleep", "600"], start=real + 1, boot_id=boot, owner=(os.getpid(), 0),
            started_at="then", members={stranger.pid: real + 1})
        record.save()
        with caplog.at_level("WARNING", logger="eagle3"):
            engines.stop_orphans(engines.records_dir(cfg), "generate")
        assert stranger.poll() is None and not record.path.exists()
        assert f"left process(es) [{stranger.pid}] of process group {stranger.pid} alone" \
               in caplog.text
        # Another stage's records are not this stage's to act on.
        record.start = record.members[stranger.pid] = real
        record.save()
        engines.stop_orphans(engines.records_dir(cfg), "bench")
        assert stranger.poll() is None and record.path.exists()
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("sig,words", [
    ("ILL", "was killed by signal SIGILL (4) during start-up: the engine's kernels need an "
            "instruction this CPU lacks (log "),
    ("KILL", "was killed by signal SIGKILL (9) during start-up: often the kernel's out-of-memory "
             "killer; check dmesg (log "),
    ("USR1", "was killed by signal SIGUSR1 (10) during start-up (log ")],
    ids=["SIGILL", "SIGKILL", "SIGUSR1"])
def test_an_engine_killed_at_start_up_names_the_signal(tmp_path, tiny_verifier, sig, words):
    exe = tmp_path / "dying-python"
    exe.write_text(f"#!/bin/sh\nulimit -c 0\nkill -s {sig} $$\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    cfg = make_config(tmp_path, tiny_verifier)
    with pytest.raises(StageError) as e:
        with engines.start_server("vllm", cfg, ServerConfig(python=str(exe)),
                                  "bench.engines[0].server", tmp_path / "d.log",
                                  max_model_len=64):
            pass
    assert str(e.value).startswith(f"vllm {words}"), str(e.value)


# ---------------------------------------------------------------------------------------------
# 5. Damaged saved cells


def test_damaged_saved_cells_are_moved_aside_and_redone(tmp_path, tiny_verifier, fake_python,
                                                        caplog):
    cfg = _bench_config(tmp_path, tiny_verifier, fake_python, num_prompts=3, concurrency=[1, 2],
                        engines=[{"name": "vllm", "depths": [1], "server": {
                            "python": fake_python, "startup_timeout_s": 30.0,
                            "env": {"FAKE_LOG": str(tmp_path / "starts.jsonl")}}}])
    stage = _export_stage(cfg)
    bench.run_bench(stage)
    results = stage.dir / "results"
    cut = results / "vllm-1_1_2-c1-mtbench-t0.json"
    listed = results / "vllm-1_1_2-c2-mtbench-t0.json"
    hollow = results / "vllm-baseline-c1-mtbench-t0.json"
    intact = results / "vllm-baseline-c2-mtbench-t0.json"
    cut.write_text(cut.read_text()[:100])  # a writer cut short (not by this code: it is atomic)
    listed.write_text("[1, 2, 3]\n")
    hollow.write_text(json.dumps({k: v for k, v in json.loads(hollow.read_text()).items()
                                  if k != "outputs"}))  # its settings still match
    kept = intact.stat().st_mtime_ns
    stage.forget_manifest()  # an unfinished stage 06
    with caplog.at_level("WARNING", logger="eagle3"):
        bench.run_bench(Stage(cfg, 6))
    assert stage.is_done() and intact.stat().st_mtime_ns == kept
    for path, problem in [(cut, "not valid JSON"), (listed, "a JSON list, not a cell's object"),
                          (hollow, "no outputs")]:
        assert f"{path} is damaged ({problem}" in caplog.text
        assert bench.cell_problem(json.loads(path.read_text())) is None  # redone
        assert len(list(results.glob(f"{path.name}.damaged-*"))) == 1  # kept, aside
