#!/usr/bin/env python
"""Load an EAGLE-3 drafter checkpoint with SGLang 0.5.23's own model class and loader, on CPU.

    python load_weights.py DRAFTER_DIR [--target-layers 61] [--target-arch llama|deepseek_v3]
                           [--aux 2,30,58 --aux 1,29,57] [--json OUT.json]

Route (all SGLang code; see REPORT.md for why each stand-in is needed):
  1. publish a ServerArgs (device=cpu, tp=1, EAGLE3, draft=DRAFTER_DIR) with SGLang's
     runtime_context.publish (runtime_context.py:1489) -> resolve_once() runs the real
     argument pipeline; the model reads get_parallel()/get_spec() from it.
  2. world-size-1 gloo process group + SGLang's model-parallel groups:
     parallel_state.init_distributed_environment(backend="gloo") and
     initialize_model_parallel(backend="gloo") (parallel_state.py:2468/2566) -- the same
     two calls as sglang/test/layer_ut_utils.py:init_single_process_dist.
  3. ModelConfig.from_server_args(..., is_draft_model=True) -> DefaultModelLoader
     (get_model_loader) -> loader_module._initialize_model (model_loader/loader.py:285)
     builds the REAL LlamaForCausalLMEagle3 (qkv_proj: QKVParallelLinear, gate_up_proj:
     MergedColumnParallelLinear, lm_head: ParallelLMHead, ...) under SGLang's
     set_default_torch_dtype(model dtype) and torch.device("cpu").
  4. every parameter is filled with NaN (sentinel), then
     DefaultModelLoader.load_weights_and_postprocess(model, loader._get_all_weights(...))
     (loader.py:1028 / 759) runs: SGLang's safetensors iterator -> model.load_weights
     (llama_eagle3.py:325) -> the parameters' own weight_loaders.
  5. per parameter: fully / partly / not written (NaN count), and a value check against
     the checkpoint (q|k|v -> qkv_proj rows, gate|up -> gate_up_proj rows, others 1:1).
  6. hot_token_id (llama_eagle3.py:350-353) vs arange(draft_vocab) + d2t.
  7. aux-layer capture: SGLang's resolve_spec_aux_hidden_state_config
     (model_runner_components/spec_aux_hidden_state.py:53) reads
     eagle_config.eagle_aux_hidden_state_layer_ids from the draft config, then
     configure_aux_hidden_state_capture (attention_backend_setup.py:40) calls the target's
     set_eagle3_layers_to_capture on REAL tiny N-layer targets built on CPU:
     LlamaForCausalLM (llama.py:929) and DeepseekV3ForCausalLM (inherits
     DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, deepseek_v2.py:3458; tiny dims,
     all layers dense).  If the DeepSeek build ever fails, the same method is called
     unbound on a stand-in (it reads only pp_group.is_last_rank, config.num_hidden_layers).
     The capture index i means "input of decoder layer i" (= HF hidden_states[i]).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore", category=UserWarning)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_cpu  # noqa: E402

T0 = time.time()


def tiny_llama_target(num_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_layers,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "hidden_act": "silu",
    }


def tiny_deepseek_v3_target(num_layers: int) -> dict:
    # all layers dense (first_k_dense_replace = num_layers): MLA attention, no MoE
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": num_layers,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
        # CPU rope path (rotary_embedding/factory.py get_rope_cpu) asserts rope_scaling
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "vocab_size": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def setup_sglang(target_dir: str, drafter_dir: str):
    """Publish server args and build SGLang's 1-process gloo parallel state."""
    sglang_cpu.install_torchvision_stub()
    # Stand-in: RotaryEmbedding.__init__ (layers/rotary_embedding/base.py:122-139)
    # imports `vllm._custom_ops.rotary_embedding` as a fallback kernel on any platform
    # that is not CUDA/CPU-engine/XPU/NPU/MUSA/MPS.  The CPU-engine flag
    # (SGLANG_USE_CPU_ENGINE=1) would need the `sgl_kernel` CPU build (not on PyPI).
    # Setting the module's `_is_cpu` (used only at base.py:124) skips that import;
    # the kernel is never used here (no forward pass).
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=target_dir, device="cpu", tp_size=1,
        speculative_algorithm="EAGLE3", speculative_draft_model_path=drafter_dir,
        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")
    return sa


def load_checkpoint_tensors(drafter_dir: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(drafter_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(drafter_dir, f)))
    return out


def build_and_load(sa, drafter_dir: str):
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model_loader
    from sglang.srt.model_loader import loader as loader_mod
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    mc = ModelConfig.from_server_args(sa, model_path=drafter_dir, is_draft_model=True)
    load_config = LoadConfig(load_format="auto")
    loader = get_model_loader(load_config, mc)
    quant_config = loader_mod._get_quantization_config(mc, load_config)
    device = torch.device("cpu")
    with set_default_torch_dtype(mc.dtype):
        with device:
            model = loader_mod._initialize_model(mc, load_config, quant_config)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        calls = []
        current = {"key": None}
        params = dict(model.named_parameters())
        # Record each call into the real weight loaders, tagged with the checkpoint key
        # being consumed. Parameters without a `weight_loader` attribute get SGLang's
        # default_weight_loader -- exactly what llama_eagle3.py:365/375 falls back to.
        from sglang.srt.model_loader.weight_utils import default_weight_loader
        for name, p in params.items():
            wl = getattr(p, "weight_loader", default_weight_loader)

            def rec(param, loaded, *args, _wl=wl, _n=name, **kw):
                shard = args[0] if args else kw.get("loaded_shard_id")
                keys = [current["key"]]
                if _n.endswith("fused_qkv_a_proj_with_mqa.weight"):
                    # the MLA loader caches one half and fuses on the other's arrival: the call
                    # consumes both checkpoint keys
                    k = current["key"]
                    half = "kv_a_proj_with_mqa" if "kv_a_proj_with_mqa" in k else "q_a_proj"
                    keys = [k.replace(half, h) for h in ("q_a_proj", "kv_a_proj_with_mqa")]
                for key in keys:
                    calls.append((key, _n, tuple(loaded.shape), shard))
                return _wl(param, loaded, *args, **kw)
            p.weight_loader = rec

        def tagged(it):
            for k, v in it:
                current["key"] = k
                yield k, v
        t = time.time()
        loader.load_weights_and_postprocess(
            model, tagged(loader._get_all_weights(mc, model)), device)
        load_s = time.time() - t
    return mc, loader, model, calls, load_s


def check_params(model, ckpt: dict):
    """Per parameter: written? equal to the checkpoint tensors SGLang should map there?"""
    import torch

    def ck(*names):
        for n in names:
            if n in ckpt:
                return ckpt[n]
        return None

    rows = []
    for name, p in model.named_parameters():
        n_nan = int(torch.isnan(p.detach().float()).sum()) if p.is_floating_point() else 0
        status = "written" if n_nan == 0 else ("NOT written" if n_nan == p.numel() else f"PARTLY written ({n_nan} NaN)")
        # expected value from checkpoint
        short = name[len("model."):] if name.startswith("model.") else name
        alt = [short, short.replace("layers.0", "midlayer")]
        exp = None
        if ".qkv_proj." in short:
            parts = [ck(*(a.replace("qkv_proj", x) for a in alt)) for x in ("q_proj", "k_proj", "v_proj")]
            exp = torch.cat(parts, 0) if all(x is not None for x in parts) else None
        elif ".fused_qkv_a_proj_with_mqa." in short:  # the MLA layer (kimi_k25_eagle3.py)
            parts = [ck(*(a.replace("fused_qkv_a_proj_with_mqa", x) for a in alt))
                     for x in ("q_a_proj", "kv_a_proj_with_mqa")]
            exp = torch.cat(parts, 0) if all(x is not None for x in parts) else None
        elif ".gate_up_proj." in short:
            parts = [ck(*(a.replace("gate_up_proj", x) for a in alt)) for x in ("gate_proj", "up_proj")]
            exp = torch.cat(parts, 0) if all(x is not None for x in parts) else None
        else:
            exp = ck(*alt)
        if exp is None:
            match = "no checkpoint key"
        elif tuple(exp.shape) != tuple(p.shape):
            match = f"shape mismatch ckpt {tuple(exp.shape)}"
        else:
            match = "== checkpoint" if torch.equal(p.detach().to(exp.dtype), exp) else "!= checkpoint"
        rows.append({"param": name, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                     "status": status, "value": match})
    return rows


def aux_capture(sa, n_layers: int, drafter_dir: str, aux_lists, tmp_root: str):
    """Run SGLang's aux-id resolution + set_eagle3_layers_to_capture on real tiny
    N-layer LlamaForCausalLM and DeepseekV3ForCausalLM targets."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    targets = {}
    llama_mc = ModelConfig.from_server_args(sa)  # the published (llama) target
    with torch.device("cpu"):
        targets["llama"] = (llama_mc, LlamaForCausalLM(llama_mc.hf_config))
    ds_dir = os.path.join(tmp_root, "deepseek_v3_target")
    os.makedirs(ds_dir, exist_ok=True)
    json.dump(tiny_deepseek_v3_target(n_layers), open(os.path.join(ds_dir, "config.json"), "w"))
    ds_note = "real DeepseekV3ForCausalLM"
    try:
        ds_mc = ModelConfig.from_server_args(sa, model_path=ds_dir)
        with torch.device("cpu"):
            targets["deepseek_v3"] = (ds_mc, DeepseekV3ForCausalLM(ds_mc.hf_config))
    except Exception as e:  # fall back: same SGLang method, unbound, on a stand-in
        ds_note = f"stand-in object (real build failed: {type(e).__name__}: {e})"
        standin = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                                  config=SimpleNamespace(num_hidden_layers=n_layers),
                                  model=SimpleNamespace(layers_to_capture=[]),
                                  capture_aux_hidden_states=False)
        standin.set_eagle3_layers_to_capture = (
            lambda ids: DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(standin, ids))
        targets["deepseek_v3"] = (llama_mc, standin)

    base_cfg = json.load(open(os.path.join(drafter_dir, "config.json")))
    results = []
    for ids in aux_lists:
        d = os.path.join(tmp_root, "draft_" + "_".join(map(str, ids or ["none"])))
        os.makedirs(d, exist_ok=True)
        cfg = copy.deepcopy(base_cfg)
        if ids is None:
            cfg.pop("eagle_config", None)
        else:
            cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        # point the published spec bag at this draft config (SGLang's own override API)
        get_context().override("load_weights.aux_probe", speculative_draft_model_path=d)
        row = {"config_ids": ids}
        for arch, (mc, model) in targets.items():
            spec = resolve_spec_aux_hidden_state_config(
                server_args=sa, model_config=mc,
                spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
                is_draft_worker=False)
            configure_aux_hidden_state_capture(
                model=model,
                eagle_use_aux_hidden_state=spec.eagle_use_aux_hidden_state,
                eagle_aux_hidden_state_layer_ids=spec.eagle_aux_hidden_state_layer_ids,
                dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None,
                is_dspark=False)
            row["resolved_ids"] = spec.eagle_aux_hidden_state_layer_ids
            row[arch] = list(model.model.layers_to_capture)
        results.append(row)
    return results, ds_note


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter_dir")
    ap.add_argument("--target-layers", type=int, default=61)
    ap.add_argument("--aux", action="append", default=None,
                    help="comma list of aux ids to probe, or 'none'; repeatable")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    drafter_dir = os.path.abspath(a.drafter_dir)
    aux_lists = [None if x == "none" else [int(v) for v in x.split(",")]
                 for x in (a.aux or ["2,30,58", "1,29,57", "none"])]
    tmp = tempfile.mkdtemp(prefix="sgl_target_")
    target_cfg = tiny_llama_target(a.target_layers)
    json.dump(target_cfg, open(os.path.join(tmp, "config.json"), "w"))

    import logging
    logging.getLogger().setLevel(logging.ERROR)
    t = time.time()
    import torch
    sa = setup_sglang(tmp, drafter_dir)
    setup_s = time.time() - t
    mc, loader, model, calls, load_s = build_and_load(sa, drafter_dir)
    ckpt = load_checkpoint_tensors(drafter_dir)
    rows = check_params(model, ckpt)
    out = {"model_class": f"{type(model).__module__}.{type(model).__name__}",
           "loader": type(loader).__name__, "dtype": str(mc.dtype),
           "timing_s": {"import+publish+dist": round(setup_s, 2), "load_weights": round(load_s, 2)},
           "params": rows,
           "weight_loader_calls": [list(c) for c in calls],
           "ignored_checkpoint_keys": sorted(set(ckpt) - {c[0] for c in calls}),
           "checkpoint_keys": sorted(ckpt)}
    # hot token map
    hot = model.get_hot_token_id() if hasattr(model, "get_hot_token_id") else None
    d2t = next((v for k, v in ckpt.items() if "d2t" in k), None)
    if hot is None:
        out["hot_token_id"] = None
    else:
        exp = torch.arange(d2t.shape[0]) + d2t
        out["hot_token_id"] = {"shape": list(hot.shape), "dtype": str(hot.dtype),
                               "equals_arange_plus_d2t": bool(torch.equal(hot, exp)),
                               "first5": hot[:5].tolist()}
    out["load_lm_head_from_target"] = getattr(model, "load_lm_head_from_target", None)
    # the draft layer: `midlayer` (MLA, kimi_k25_eagle3.py) or `layers[0]` (llama_eagle3.py)
    layer = getattr(model.model, "midlayer", None) or model.model.layers[0]
    attn = getattr(layer, "self_attn", None)
    if hasattr(attn, "rotary_emb"):  # SGLang's softmax scale and rope table of the draft layer
        cache = attn.rotary_emb.cos_sin_cache
        positions = [0, 1, 37, 1000, 3000, 8000]
        table = cache[[p for p in positions if p < cache.shape[0]]]
        out["attention"] = {"scaling": float(attn.scaling),
                            "rotary_class": type(attn.rotary_emb).__name__,
                            "neox_style": bool(getattr(attn.rotary_emb, "is_neox_style", True)),
                            "positions": positions, "cos_sin_cache": table.float().tolist()}
    # What the EAGLE worker does next (eagle_worker_v2.py:353-363): unless the draft must
    # load its lm_head from the target, it calls model.set_embed(target_embed)
    # (llama.py:910), which is a no-op when config.target_hidden_size != hidden_size.
    emb = model.model.embed_tokens.weight
    # Stand-in: the MLA drafter's set_embed (kimi_k25_eagle3.py) ends with
    # torch.cuda.empty_cache() and torch.cuda.synchronize(); on CPU there is nothing to wait for.
    torch.cuda.empty_cache = torch.cuda.synchronize = lambda *a, **k: None
    fake_target_embed = torch.nn.Parameter(torch.zeros(emb.shape, dtype=emb.dtype), requires_grad=False)
    if out["load_lm_head_from_target"]:
        out["embed_after_set_embed"] = "load_lm_head_from_target=True: worker calls set_embed_and_head(target embed, target head)"
    else:
        model.set_embed(fake_target_embed)
        shared = model.model.embed_tokens.weight is fake_target_embed
        out["embed_after_set_embed"] = ("replaced by the target's embedding (set_embed)" if shared else
                                        "set_embed was a no-op (target_hidden_size != hidden_size): "
                                        "draft keeps its own embed_tokens -> must come from the checkpoint")
        if not shared and torch.isnan(model.model.embed_tokens.weight.float()).any():
            out["embed_after_set_embed"] += " -- STILL UNWRITTEN (NaN)"
    out["aux"], out["deepseek_target"] = aux_capture(sa, a.target_layers, drafter_dir, aux_lists, tmp)
    out["timing_s"]["total"] = round(time.time() - T0, 2)

    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1, default=str)
    print(f"model: {out['model_class']}  loader: {out['loader']}  dtype: {out['dtype']}")
    print(f"checkpoint keys: {out['checkpoint_keys']}")
    print("parameters:")
    for r in rows:
        print(f"  {r['param']:48s} {str(r['shape']):14s} {r['dtype']:9s} {r['status']:12s} {r['value']}")
    not_written = [r["param"] for r in rows if r["status"] != "written"]
    print(f"not fully written: {not_written or 'none'}")
    print(f"checkpoint keys that reached no parameter: {out['ignored_checkpoint_keys']}"
          " (d2t -> hot_token_id, t2d skipped by design: llama_eagle3.py:350-356)")
    print("weight_loader calls (checkpoint key, param, ckpt shape, shard_id):")
    for c in calls:
        print(f"  {c}")
    print(f"hot_token_id: {out['hot_token_id']}")
    print(f"load_lm_head_from_target: {out['load_lm_head_from_target']}")
    print(f"model.embed_tokens after the worker's set_embed step: {out['embed_after_set_embed']}")
    print(f"aux capture on a {a.target_layers}-layer target "
          "(index i = input of decoder layer i = HF hidden_states[i]):")
    for r in out["aux"]:
        print(f"  eagle_aux_hidden_state_layer_ids={r['config_ids']} -> resolved {r['resolved_ids']}"
              f" | LlamaForCausalLM layers_to_capture={r['llama']}"
              f" | DeepseekV3ForCausalLM layers_to_capture={r['deepseek_v3']}")
    print(f"  (DeepSeek target: {out['deepseek_target']})")
    print(f"timing: {out['timing_s']}")


if __name__ == "__main__":
    main()
