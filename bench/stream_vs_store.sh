#!/usr/bin/env bash
# Streamed hidden states against stored ones on the demo (issue 32 E): the demo's stages 01 and
# 03 run once and are shared (hard links); one run stores stage 02's states and trains from the
# disk, the other streams them from the in-process verifier (hidden_states.mode=stream); same
# training, same export, same vLLM-CPU bench (K=3, T=0 and 1, 40 MT-bench prompts). Then the
# batching noise between the two: the states of 256 samples computed as stage 04 groups them
# against the stored ones.
#
#     bash bench/stream_vs_store.sh          # about 30 minutes on 2 cores; run nothing beside it
#     SEED=1 bash bench/stream_vs_store.sh   # another training seed (train.seed) on the same
#                                            # stages 01-03 (hard links to seed 0's): ~40 min
set -euo pipefail
cfg=configs/smollm2-135m-cpu.yaml
py=.venv/bin/python
seed=${SEED:-0}
sfx=""
[ "$seed" = 0 ] || sfx="-s$seed"
store=stream-vs-store-store$sfx stream=stream-vs-store-stream$sfx
common=('bench.engines=[{"name": "vllm", "depths": [3], "draft_sample": "probabilistic", "baseline": false}]'
        'bench.temperature=[0.0,1.0]' 'bench.concurrency=[1]' bench.num_prompts=40
        bench.max_tokens=64 'export.formats=[vllm]' "train.seed=$seed")
if [ "$seed" != 0 ] && [ -e runs/stream-vs-store-store/03_vocab/manifest.json ]; then
    mkdir -p "runs/$store"  # the seed changes training only: stages 01-03 are seed 0's
    for s in 01_data 02_hidden_states 03_vocab; do
        [ -e "runs/$store/$s" ] || cp -al "runs/stream-vs-store-store/$s" "runs/$store/"
    done
fi
for s in 01_generate_data.py 02_extract_hidden_states.py 03_build_vocab_map.py; do
    $py "$s" "$cfg" run.name=$store "${common[@]}"
done
mkdir -p "runs/$stream"
for s in 01_data 03_vocab; do
    [ -e "runs/$stream/$s" ] || cp -al "runs/$store/$s" "runs/$stream/"
done
$py 02_extract_hidden_states.py "$cfg" run.name=$stream hidden_states.mode=stream "${common[@]}"
for s in 04_train.py 05_fix_keys.py 06_deploy_and_bench.py; do
    $py "$s" "$cfg" run.name=$store "${common[@]}"
    $py "$s" "$cfg" run.name=$stream hidden_states.mode=stream "${common[@]}"
done
$py - "$cfg" "$sfx" <<'PY'
import contextlib, json, sys, time
from pathlib import Path
import torch
from eagle3 import dist
from eagle3.config import load_config
from eagle3.runs import Stage
from eagle3.shards import HiddenStates
from eagle3.stream import StreamedStates, open_streamed
from eagle3.train import epoch_batches

sfx = sys.argv[2]
for mode in ("store", "stream"):
    run = Path(f"runs/stream-vs-store-{mode}{sfx}")
    hs = json.load(open(run / "02_hidden_states/manifest.json"))
    train = json.load(open(run / "04_train/manifest.json"))
    cells = json.load(open(run / "06_bench/results.json"))["results"]
    acc = {r["temperature"]: round(r["mean_acceptance_length"], 3) for r in cells if r["depth"]}
    disk = sum(f.stat().st_size for f in (run / "02_hidden_states").rglob("*") if f.is_file())
    print(f"{mode}: stage 02 {hs['timings']['seconds']} s, {disk / 1e6:.1f} MB on disk; stage 04 "
          f"{train['timings']['seconds']} s, best val est {train['counts']['best_val_est_accept_len']:.3f}; "
          f"vLLM K=3 acceptance by T {acc}")
    for r in train.get("data_flow", []):
        print("   ", {k: r[k] for k in ("epoch", "step_s", "wait_fraction", "producer_tokens_per_s",
                                        "trainer_tokens_per_s", "buffer_max")})

if sfx:
    sys.exit(0)  # the batching noise below does not depend on the training seed
# Batching noise: stage 04's micro-batches of epoch 0 streamed, against the stored states.
cfg = load_config(sys.argv[1], ["run.name=stream-vs-store-stream", "hidden_states.mode=stream"])
stage = Stage(cfg, 4)
stored = HiddenStates(Stage(load_config(sys.argv[1], ["run.name=stream-vs-store-store"]), 2).dir)
with contextlib.ExitStack() as stack:
    streamed = open_streamed(stage, dist.init("cpu"), stack)
    lengths = [stored.num_tokens(i) for i in range(len(stored))]
    groups = epoch_batches(lengths, list(range(len(stored))), cfg.train.batch_tokens, 0, 0)
    worst, diff, total, equal, n = 0.0, 0.0, 0, 0, 0
    for g in groups:
        for i, got in zip(g, streamed.get(g)):
            want = stored[i]
            for name in ("aux", "final"):
                a, b = got[name].float(), want[name].float()
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
                diff += float((a - b).abs().sum()); total += b.numel()
            equal += torch.equal(got["aux"], want["aux"]) and torch.equal(got["final"], want["final"])
            n += 1
        if n >= 256:
            break
print(f"batching noise over {n} samples: {equal} bit-identical, largest difference "
      f"{worst:.3g} of the tensor's magnitude, mean |difference| {diff / total:.3g}")
PY
