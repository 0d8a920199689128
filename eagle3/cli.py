"""The one command-line shape shared by the six stage scripts.

    python 0N_<stage>.py CONFIG [section.key=value ...] [--restart | --repair] [--debug]

Loads and checks the config, takes the stage's locks, checks everything the stage reads
(upstream manifests, their files, the verifier) before touching anything, then skips a stage
that is already complete or runs it. `--restart` moves the stage's output aside (only after
those checks pass); `--repair` reruns a finished stage over its output, which keeps every
intact unit and redoes the damaged ones. A user mistake, bad input or a full disk ends in one
line on stderr and exit code 2; any other failure in one line naming where it happened (exit
1). `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from eagle3 import dist
from eagle3.config import ConfigError, load_config
from eagle3.runs import Stage, StageError, is_rank0
from eagle3.verifier import check_weights

log = logging.getLogger("eagle3")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    # One line per HTTP request would bury the stage's own progress lines.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


COMMON_ALIASES = {"--finetune-from": "train.finetune_from"}
"""Flags every stage takes: the base drafter shapes stages 02 (its aux convention is measured),
03 (its vocabulary map is copied) and 04, so the fine-tune flow gives it to each stage alike."""


def _parse(description: str, argv: Optional[list[str]], aliases: dict[str, str],
           smoke: bool = False) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("config", help="pipeline YAML, e.g. configs/smollm2-135m-cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--restart", action="store_true",
                       help="move this stage's output aside and start it over")
    again.add_argument("--repair", action="store_true",
                       help="rerun a finished stage over its output: redo only what is damaged")
    if smoke:
        again.add_argument("--smoke", action="store_true",
                           help="one step on the longest samples: peak memory and speed; "
                                "writes nothing")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    aliases = {**COMMON_ALIASES, **aliases}
    for flag, key in aliases.items():
        parser.add_argument(flag, dest=key.replace(".", "__"), default=None,
                            help=f"same as {key}=VALUE")
    args = parser.parse_intermixed_args(argv)  # flags may sit between overrides
    overrides = list(args.overrides)
    for flag, key in aliases.items():
        value = getattr(args, key.replace(".", "__"))
        if value is not None:
            overrides.append(f"{key}={value}")
    return args, overrides


def _prepare(stage: Stage, args: argparse.Namespace,
             preflight: Optional[Callable[[Stage], None]]) -> bool:
    """Rank 0, under the stage's locks: check what the stage reads, then move or forget the old
    output as asked. Returns True when the stage is already complete."""
    stage.cfg.verifier_info  # the verifier's config.json must be readable for every stage
    check_weights(stage.cfg.verifier_path)
    for n in stage.spec.upstream:
        stage.require(n)
    if preflight is not None:
        preflight(stage)
    if args.restart:
        moved = stage.restart()
        if moved:
            log.info("moved the previous %s aside to %s", stage.name, moved)
    elif args.repair and stage.is_done():
        stage.forget_manifest()
        log.info("%s: redoing what is damaged, keeping the rest", stage.name)
    return stage.check_done()


def _run(stage: Stage, run: Callable[[Stage], None], args: argparse.Namespace,
         preflight: Optional[Callable[[Stage], None]], devices: bool,
         smoke: Optional[Callable[[Stage], None]]) -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed or devices:  # before any check of the inputs: a missing GPU fails at once
        dist.init(stage.cfg.train.device, stage.cfg.train.collective_timeout_min)
    stage.hash_by_ranks = distributed
    with stage.lock() if is_rank0() else _no_lock():
        done = _prepare(stage, args, preflight) if is_rank0() else False
        if distributed:  # the other ranks wait for rank 0's checks, restart or repair
            dist.barrier()
            # then all of them hash the upstream files, each its share
            stage.verify_upstream_by_ranks(int(os.environ.get("RANK", "0")),
                                           int(os.environ["WORLD_SIZE"]), dist.gather_objects)
            done = stage.check_done()
        if getattr(args, "smoke", False) and smoke is not None:
            smoke(stage)
            return
        if done:
            log.info("%s is already complete in %s; nothing to do (--restart redoes it)",
                     stage.name, stage.dir)
            return
        log.info("%s: run %s, verifier %s", stage.name, stage.cfg.run_dir,
                 stage.cfg.verifier.path)
        started = time.time()
        run(stage)
        log.info("%s done in %.1f s -> %s", stage.name, time.time() - started, stage.dir)


class _no_lock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _disk_full_message(path: Optional[Path], stage: Optional[Stage]) -> str:
    where = path or (stage.dir if stage else Path("."))
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 1e9
    need = ""
    if stage is not None and stage.needs_bytes:
        need = f"; this stage still needed about {stage.needs_bytes / 1e9:.2f} GB"
    return (f"disk full while writing {where} ({free:.2f} GB free{need}): free space or point "
            f"run.dir at a larger disk, then rerun (finished parts are kept)")


def stage_main(number: int, run: Callable[[Stage], None], description: str,
               argv: list[str] | None = None, aliases: dict[str, str] | None = None,
               preflight: Optional[Callable[[Stage], None]] = None,
               devices: bool = False, smoke: Optional[Callable[[Stage], None]] = None) -> int:
    """Entry point of stage `number`. `aliases` maps extra `--flag VALUE` options to config keys
    (e.g. {"--finetune-from": "train.finetune_from"}); `preflight` runs the stage's own checks
    of its inputs before anything is moved or written. `devices`: the stage trains on
    `train.device`, checked before anything else. `smoke`: what `--smoke` runs instead of
    the stage (after the same checks; it must write nothing)."""
    args, overrides = _parse(description, argv, aliases or {}, smoke is not None)
    setup_logging()
    stage: Optional[Stage] = None
    try:
        stage = Stage(load_config(args.config, overrides), number)
        _run(stage, run, args, preflight, devices, smoke)
        return 0
    except (ConfigError, StageError, dist.DeviceError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the last resort: one line, not 80
        if args.debug:
            traceback.print_exc()
        if _is_disk_full(e):
            filename = getattr(e, "filename", None)
            print(f"error: {_disk_full_message(Path(filename) if filename else None, stage)}",
                  file=sys.stderr)
            return 2
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC, raised as OSError by Python or as another type by native writers (safetensors,
    torch.save, Arrow) that only keep the OS message."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _one_line(e: BaseException) -> str:
    """`Type: message (at file:line)` of an unexpected failure, innermost frame first."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}{where}; rerun with --debug for the traceback"
