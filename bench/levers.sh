#!/usr/bin/env bash
# One row of the lever table in bench/RESULTS.md (issue 14): a finished run's stages 01-02 (and
# 03 unless the lever sets vocab.*) shared by hard links, then stages 03-06 with the lever's
# overrides, vLLM at K=3 on the 80 MT-bench prompts at T=0 and T=0.6, and the training-time
# estimate on the text the engine served.
#
#     bash bench/levers.sh NAME SOURCE_RUN [section.key=value ...]
#     bash bench/levers.sh ttt5 lk-kl train.ttt_steps=5
set -euo pipefail
name=$1; src=$2; shift 2
cfg=${CONFIG:-configs/smollm2-135m-cpu.yaml}
py=.venv/bin/python
bench=('bench.engines.0.depths=[3]' bench.engines.0.baseline=false 'bench.concurrency=[4]'
       'bench.temperature=[0.0,0.6]' bench.num_prompts=80)
shared=(01_data 02_hidden_states)
[[ " $* " == *" vocab."* ]] || shared+=(03_vocab)
mkdir -p "runs/$name"
for s in "${shared[@]}"; do   # hard links: no stage writes into an upstream stage
    [ -e "runs/$name/$s" ] || cp -al "runs/$src/$s" "runs/$name/"
done
for script in 03_build_vocab_map.py 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$script" "$cfg" "run.name=$name" "$@" "${bench[@]}"
done
$py bench/bench_quality.py "$cfg" "run.name=$name" "$@" --temperature 0.6
$py - "$name" <<'PY'
import json, sys
name = sys.argv[1]
q = json.load(open(f"runs/{name}/bench_quality_k3_t0.6.json"))
m = json.load(open(f"runs/{name}/04_train/manifest.json"))
print(f"| {name} | {m['counts']['best_val_est_accept_len']:.3f} | {q['engine_accept_len']:.3f} "
      f"| {q['estimate_accept_len']:.3f} ({100 * q['relative_gap']:+.1f}%) "
      f"| {q['engine_accept_len_sampled']:.3f} | {q['estimate_accept_len_sampled']:.3f} / "
      f"{q['estimate_accept_len_greedy_draft']:.3f} | {m['timings']['seconds']:.0f} s |")
PY
