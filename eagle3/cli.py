"""The one command-line shape shared by the six stage scripts.

    python 0N_<stage>.py CONFIG [section.key=value ...] [--restart]

Parses, loads and logs the config, skips a stage that is already complete, and turns user
mistakes (ConfigError, StageError) into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable

from eagle3 import dist
from eagle3.config import ConfigError, load_config
from eagle3.runs import Stage, StageError

log = logging.getLogger("eagle3")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    # One line per HTTP request would bury the stage's own progress lines.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def stage_main(number: int, run: Callable[[Stage], None], description: str,
               argv: list[str] | None = None,
               aliases: dict[str, str] | None = None) -> int:
    """Entry point of stage `number`. `aliases` maps extra `--flag VALUE` options to config keys
    (e.g. {"--finetune-from": "train.finetune_from"})."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("config", help="pipeline YAML, e.g. configs/smollm2-135m-cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--restart", action="store_true",
                        help="move this stage's output aside and start it over")
    for flag, key in (aliases or {}).items():
        parser.add_argument(flag, dest=key.replace(".", "__"), default=None,
                            help=f"same as {key}=VALUE")
    args = parser.parse_intermixed_args(argv)  # flags may sit between overrides
    setup_logging()
    overrides = list(args.overrides)
    for flag, key in (aliases or {}).items():
        value = getattr(args, key.replace(".", "__"))
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        cfg = load_config(args.config, overrides)
        stage = Stage(cfg, number)
        if args.restart:
            # Under torchrun only rank 0 moves the output aside; the others wait for it.
            ctx = dist.init() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
            if ctx is None or ctx.is_main:
                moved = stage.restart()
                if moved:
                    log.info("moved the previous %s aside to %s", stage.name, moved)
            dist.barrier()
        if stage.check_done():
            log.info("%s is already complete in %s; nothing to do (--restart redoes it)",
                     stage.name, stage.dir)
            return 0
        log.info("%s: run %s, verifier %s", stage.name, cfg.run_dir, cfg.verifier.path)
        started = time.time()
        run(stage)
        log.info("%s done in %.1f s -> %s", stage.name, time.time() - started, stage.dir)
        return 0
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
