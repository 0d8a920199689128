#!/usr/bin/env bash
# The MLA draft layer against the Llama (MHA) one on SmolLM2 (issue 31 E): the same data (stages
# 01-03 run once, shared by hard links), the same training (random init: a verifier layer can
# start only the MHA layer), only `draft.attention` changed. An MLA drafter serves in vLLM only
# beside an MLA verifier (docs/engines.md, "vLLM and MLA"), so both are measured by the reference
# decoder (eagle3/reference_decoder.py): K=3, sampled drafts, T=0 and T=1, the config's MT-bench
# prompts and tokens, one request at a time. MLA widths in Kimi's proportions at SmolLM2's size
# (9 heads of 64): q_lora 256, kv_lora 128, nope 64, rope 32, v 64.
#
#     bash bench/mla_vs_mha.sh                          # the demo's data, its 2 epochs
#     CONFIG=configs/smollm2-135m-quality.yaml SRC=smollm2-135m-quality PREFIX=q1-mla-vs-mha \
#         bash bench/mla_vs_mha.sh train.epochs=1       # a finished run's stages 01-03
#
# Trailing arguments are overrides for both runs. SRC names a finished run whose stages 01-03
# are shared; without it they run into the MHA run first.
set -euo pipefail
cfg=${CONFIG:-configs/smollm2-135m-cpu.yaml}
prefix=${PREFIX:-mla-vs-mha}
py=.venv/bin/python
common=(train.init_layer=random 'export.formats=[vllm,sglang]'
        'bench.engines=[{"name": "hf", "depths": [3], "draft_sample": "probabilistic", "baseline": false}]'
        'bench.temperature=[0.0,1.0]' 'bench.concurrency=[1]' "$@")
mla=(draft.attention=mla draft.q_lora_rank=256 draft.kv_lora_rank=128 draft.qk_nope_head_dim=64
     draft.qk_rope_head_dim=32 draft.v_head_dim=64)
if [ -z "${SRC:-}" ]; then
    for s in 01_generate_data.py 02_extract_hidden_states.py 03_build_vocab_map.py; do
        $py "$s" "$cfg" "run.name=$prefix-mha" "${common[@]}"
    done
    SRC=$prefix-mha
fi
for layer in mha mla; do   # hard links: no stage writes into an upstream stage
    mkdir -p "runs/$prefix-$layer"
    for s in 01_data 02_hidden_states 03_vocab; do
        [ -e "runs/$prefix-$layer/$s" ] || cp -al "runs/$SRC/$s" "runs/$prefix-$layer/"
    done
done
for s in 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$s" "$cfg" "run.name=$prefix-mha" "${common[@]}"
    $py "$s" "$cfg" "run.name=$prefix-mla" "${common[@]}" "${mla[@]}"
done
$py - "$prefix" <<'PY'
import json, sys
for layer in ("mha", "mla"):
    run = f"runs/{sys.argv[1]}-{layer}"
    train = json.load(open(f"{run}/04_train/manifest.json"))
    cells = json.load(open(f"{run}/06_bench/results.json"))["results"]
    acc = {r["temperature"]: round(r["mean_acceptance_length"], 3) for r in cells if r["depth"]}
    print(layer, "params", train.get("counts", {}).get("trainable_parameters"),
          "train s", round(train.get("timings", {}).get("seconds") or 0), "acceptance by T", acc,
          "val", train.get("counts", {}).get("best_val_est_accept_len"))
PY
