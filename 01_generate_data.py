"""The verifier answers training prompts: conversations, token ids and assistant loss masks.

    python 01_generate_data.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]

Writes <run>/01_data/; rerun after a crash to continue where it stopped.
"""

import sys

from eagle3.cli import stage_main
from eagle3.generate import run_generate

if __name__ == "__main__":
    sys.exit(stage_main(1, run_generate, __doc__.splitlines()[0]))
