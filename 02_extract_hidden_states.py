"""Capture the verifier's aux and final hidden states for every training sample.

    python 02_extract_hidden_states.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]

Writes <run>/02_hidden_states/; rerun after a crash to continue where it stopped.
"""

import sys

from eagle3.cli import stage_main
from eagle3.hidden_states import run_extract

if __name__ == "__main__":
    sys.exit(stage_main(2, run_extract, __doc__.splitlines()[0]))
