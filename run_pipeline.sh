#!/usr/bin/env bash
# Run the six stages in order: bash run_pipeline.sh CONFIG [FROM_STAGE] [section.key=value ...]
# Each stage skips itself when already complete, so rerunning after a crash continues the run.
# CONFIG may be given relative to the directory you run this from. `--plan` anywhere prints
# what the run will do and cost, and its preflight checks, and runs nothing (eagle3.plan).
# Stage 04 runs under torchrun with one process per GPU torch sees (NPROC_PER_NODE overrides
# the count), so that the run trains as the runbook's torchrun command does and a later
# torchrun resume finds the same world size.
set -euo pipefail
usage="usage: bash run_pipeline.sh CONFIG [FROM_STAGE 1-6] [section.key=value ...]"
if [ $# -lt 1 ]; then
  echo "$usage" >&2
  exit 2
fi
config=$1; shift
if [ ! -f "$config" ]; then
  echo "error: config file not found: $config ($usage)" >&2
  exit 2
fi
config=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
from=1
if [ $# -gt 0 ] && [[ $1 != *=* ]] && [[ $1 != --* ]]; then
  if [[ ! $1 =~ ^[1-6]$ ]]; then
    echo "error: FROM_STAGE must be a stage number 1-6, got '$1' ($usage)" >&2
    exit 2
  fi
  from=$1; shift
fi
cd "$(dirname "$0")"
# HF_HUB_OFFLINE is the caller's: a node fetches hub sources, bases and bench sets online
# (`make demo` runs offline).
export TOKENIZERS_PARALLELISM=false
py=python
[ -x .venv/bin/python ] && py=.venv/bin/python
rest=()
plan=0
for arg in "$@"; do
  if [ "$arg" = "--plan" ]; then plan=1; else rest+=("$arg"); fi
done
if [ $plan = 1 ]; then
  exec "$py" -m eagle3.plan "$config" ${rest[@]+"${rest[@]}"}
fi
scripts=(01_generate_data.py 02_extract_hidden_states.py 03_build_vocab_map.py 04_train.py
         05_fix_keys.py 06_deploy_and_bench.py)
gpus=${NPROC_PER_NODE:-$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null \
                         || echo 0)}
for i in $(seq "$from" 6); do
  script=${scripts[$((i - 1))]}
  launch=("$py") how=""
  if [ "$i" = 4 ] && [ "$gpus" -gt 1 ]; then
    launch=("$py" -m torch.distributed.run --standalone --nproc_per_node "$gpus")
    how="torchrun --nproc_per_node $gpus "
  fi
  echo "=== stage $i: $how$script ==="
  start=$(date +%s)
  "${launch[@]}" "$script" "$config" "$@"
  echo "=== stage $i done in $(( $(date +%s) - start )) s ==="
done
