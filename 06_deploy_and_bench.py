"""Serve verifier + drafter and benchmark speculative decoding against a baseline.

    python 06_deploy_and_bench.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]

Writes <run>/06_bench/; rerun after a crash to continue where it stopped. SIGTERM (timeout,
Slurm, Kubernetes) stops the running engine with its workers and exits with code 143.
"""

import sys

from eagle3.cli import stage_main
from eagle3.bench import run_bench

if __name__ == "__main__":
    sys.exit(stage_main(6, run_bench, __doc__.splitlines()[0]))
