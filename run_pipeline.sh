#!/usr/bin/env bash
# Run the six stages in order: bash run_pipeline.sh CONFIG [FROM_STAGE] [section.key=value ...]
# Each stage skips itself when already complete, so rerunning after a crash continues the run.
set -euo pipefail
cd "$(dirname "$0")"
if [ $# -lt 1 ]; then
  echo "usage: bash run_pipeline.sh CONFIG [FROM_STAGE] [section.key=value ...]" >&2
  exit 2
fi
config=$1; shift
from=1
if [ $# -gt 0 ] && [[ $1 =~ ^[1-6]$ ]]; then from=$1; shift; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=python
[ -x .venv/bin/python ] && py=.venv/bin/python
scripts=(01_generate_data.py 02_extract_hidden_states.py 03_build_vocab_map.py 04_train.py
         05_fix_keys.py 06_deploy_and_bench.py)
for i in $(seq "$from" 6); do
  script=${scripts[$((i - 1))]}
  echo "=== stage $i: $script ==="
  start=$(date +%s)
  "$py" "$script" "$config" "$@"
  echo "=== stage $i done in $(( $(date +%s) - start )) s ==="
done
