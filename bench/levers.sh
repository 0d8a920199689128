#!/usr/bin/env bash
# One row of the lever table in bench/RESULTS.md (issue 14): a finished run's stages 01-02 (and
# 03 unless the lever sets vocab.*) shared by hard links, then stages 03-06 with the lever's
# overrides, vLLM at K=3 on the 80 MT-bench prompts at T=0, 0.6 and 1.0, and the training-time
# estimate on the text the engine served at each. Stages already in runs/NAME are kept (link
# 04_train and 05_export there to serve the same drafter another way). SCREEN=1 serves at
# T=0 only and prints the T=0 figures: a ~10 min screen of a lever on the demo's data.
#
#     bash bench/levers.sh NAME SOURCE_RUN [section.key=value ...]
#     bash bench/levers.sh ttt5 lk-kl train.ttt_steps=5
#     SCREEN=1 bash bench/levers.sh s-sharp kl train.kl_temperature=0.5
set -euo pipefail
name=$1; src=$2; shift 2
cfg=${CONFIG:-configs/smollm2-135m-cpu.yaml}
py=.venv/bin/python
temps='[0.0,0.6,1.0]'; [ -z "${SCREEN:-}" ] || temps='[0.0]'
bench=('bench.engines.0.depths=[3]' bench.engines.0.baseline=false 'bench.concurrency=[4]'
       "bench.temperature=$temps" bench.num_prompts=80)
shared=(01_data 02_hidden_states)
[[ " $* " == *" vocab."* ]] || shared+=(03_vocab)
mkdir -p "runs/$name"
for s in "${shared[@]}"; do   # hard links: no stage writes into an upstream stage
    [ -e "runs/$name/$s" ] || cp -al "runs/$src/$s" "runs/$name/"
done
for script in 03_build_vocab_map.py 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$script" "$cfg" "run.name=$name" "$@" "${bench[@]}"
done
if [ -n "${SCREEN:-}" ]; then
    $py bench/bench_quality.py "$cfg" "run.name=$name" "$@"
    exit
fi
for t in 0.6 1; do
    $py bench/bench_quality.py "$cfg" "run.name=$name" "$@" --temperature $t
done
$py - "$name" <<'PY'
import json, sys
name = sys.argv[1]
q = {t: json.load(open(f"runs/{name}/bench_quality_k3_t{t}.json")) for t in ("0.6", "1")}
m = json.load(open(f"runs/{name}/04_train/manifest.json"))
cell = json.load(open(f"runs/{name}/06_bench/results/vllm-3_1_4-c4-mtbench-t0.6.json"))
drafts = cell["settings"].get("draft_sample", "greedy")  # the estimate of the engine's drafting
gap = lambda e, x: f"{x:.3f} ({100 * (x / e - 1):+.1f}%)"  # noqa: E731
row = [f"{name} ({drafts} drafts)", f"{m['counts']['best_val_est_accept_len']:.3f}",
       f"{q['0.6']['engine_accept_len']:.3f}", gap(q['0.6']['engine_accept_len'],
                                                  q['0.6']['estimate_accept_len'])]
for t in ("0.6", "1"):
    e = q[t]["engine_accept_len_sampled"]
    row += [f"{e:.3f}", gap(e, q[t]["estimate_accept_len_sampled" if drafts == "probabilistic"
                                    else "estimate_accept_len_greedy_draft"])]
row.append(f"{m['timings']['seconds']:.0f} s")
print("| " + " | ".join(row) + " |")
PY
