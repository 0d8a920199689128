"""Train the EAGLE-3 drafter with training-time test; resumes from the latest checkpoint.

    python 04_train.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]
    python 04_train.py CONFIG --smoke    # one step on the longest samples: peak memory, tok/s

Writes <run>/04_train/; rerun after a crash to continue where it stopped.
"""

import sys

from eagle3.cli import stage_main
from eagle3.train import preflight, run_train, smoke

if __name__ == "__main__":
    sys.exit(stage_main(4, run_train, __doc__.splitlines()[0],
                        preflight=preflight, devices=True, smoke=smoke))
