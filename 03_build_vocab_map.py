"""Build the draft vocabulary (d2t offsets, t2d mask) from loss-masked token counts.

    python 03_build_vocab_map.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]

Writes <run>/03_vocab/; rerun after a crash to continue where it stopped.
"""

import sys

from eagle3.cli import stage_main
from eagle3.vocab import run_vocab

if __name__ == "__main__":
    sys.exit(stage_main(3, run_vocab, __doc__.splitlines()[0]))
