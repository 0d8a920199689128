"""Export the trained drafter to the exact layouts vLLM, SGLang and speculators load.

    python 05_fix_keys.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]

Writes <run>/05_export/; rerun after a crash to continue where it stopped.
"""

import sys

from eagle3.cli import stage_main
from eagle3.export import run_export

if __name__ == "__main__":
    sys.exit(stage_main(5, run_export, __doc__.splitlines()[0]))
