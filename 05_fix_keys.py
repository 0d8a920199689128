"""Export the trained drafter to the exact layouts vLLM, SGLang and speculators load.

    python 05_fix_keys.py configs/smollm2-135m-cpu.yaml [section.key=value ...] [--restart | --repair]
    python 05_fix_keys.py --from DRAFTER_DIR --out DIR [--verifier PATH] [--formats ...]

The first writes <run>/05_export/ from the run's checkpoint; the second converts any EAGLE-3
drafter directory (speculators, SGLang/AQ-MedAI, vLLM layouts). Rerun either after a crash to
continue where it stopped.
"""

import sys

if __name__ == "__main__":
    if "--from" in sys.argv[1:]:
        from eagle3.convert import convert_main
        sys.exit(convert_main(sys.argv[1:]))
    from eagle3.cli import stage_main
    from eagle3.export import run_export
    sys.exit(stage_main(5, run_export, __doc__.splitlines()[0]))
