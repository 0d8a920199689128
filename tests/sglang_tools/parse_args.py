#!/usr/bin/env python
"""Parse an SGLang 0.5.23 launch command with SGLang's own code, on a CPU-only box.

    python parse_args.py [--platform cpu|h100|b200] [--target-config PRESET|FILE]
                         [--draft-config PRESET|FILE] [--json] -- \
        python -m sglang.launch_server --model-path /x/verifier \
        --speculative-algorithm EAGLE3 --speculative-draft-model-path /x/draft ...
    python parse_args.py --cases cases.json      # many commands, one import of SGLang

cases.json is a list of {"argv": [...], "platform", "target_config", "draft_config",
"backends"}; the answer is one JSON list, per case the resolved fields or {"error", "message"}.
With "backends": true the answer also has "backends": {"target": ..., "draft": ...}, the
attention backend SGLang's ModelRunner code creates for each (draft_runner.py).

What runs (all SGLang code, nothing re-implemented):
  * sglang.srt.server_args.prepare_server_args(argv)      server_args.py:668
      = argparse + ServerArgs.add_cli_args (server_args.py:351) + ServerArgs.from_cli_args
        (server_args.py:446) -- exactly what `python -m sglang.launch_server` does
        (launch_server.py:81).
  * ServerArgs.resolve_once()                             server_args.py:244
      = run_resolution_pipeline (arg_groups/pipeline.py:20), the whole post-processing
        pipeline that launch_server.run_server runs (launch_server.py:29), including
        handle_speculative_decoding (arg_groups/speculative_hook.py:121) ->
        SpeculativeAlgorithm.handle_server_args (speculative/spec_info.py:235) ->
        _handle_eagle_family (speculative_hook.py:1072).
  * resolved values are read with sglang.srt.arg_groups.overrides.resolution_result
    (overrides.py:178): 0.5.23 never writes back into the ServerArgs fields; each
    rule appends (source, {field: value}) to server_args._resolved_overrides.

Stand-ins (the only non-SGLang parts):
  * --device: resolution calls get_device() (serving_hook.py:648-653) which raises
    "No accelerator ..." without a GPU, so unless the command has --device we add
    `--device cpu` (platform cpu) or `--device cuda` (platforms h100 / b200).
  * platform facts: for h100 / b200 we install SGLang's own test hook
    sglang.srt.runtime_context.override_platform(...) (runtime_context.py:1950) so
    get_platform().is_sm90/is_sm100/has_flashinfer/... answer as on that GPU. This
    matters for the default attention backend (model_override_base.py:277), which
    decides whether the trtllm_mha topk rule (speculative_hook.py:1174) can fire.
  * model directories: resolution loads the target's config.json (model_config_of)
    and the draft's config.json (speculative_hook.py:88). A path that does not exist
    here is replaced by a temp dir holding a stand-in config.json (--target-config /
    --draft-config: a preset name or a config.json file); printed paths are mapped back.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", category=UserWarning)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_cpu  # noqa: E402

PRESETS = {
    # SmolLM2-135M-like Llama target (auto params for LlamaForCausalLM: 5/4/8).
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    },
    # DeepSeek-V3-like 61-layer MLA/MoE target (auto params 3/1/4; fp8 block quant).
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
            "type": "yarn"},
        "vocab_size": 129280, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    # EAGLE-3 drafter (SGLang/EAGLE layout). Only `architectures` is read at
    # argument-resolution time (speculative_hook.py:95: Gemma4 assistant check).
    "eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "draft_vocab_size": 8192, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
}

PLATFORMS = {
    "cpu": None,
    "h100": dict(is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False,
                 is_mps=False, has_amx=False, has_flashinfer=True, is_sm90=True,
                 is_sm100=False, is_sm100_or_sm110=False, is_sm110=False, is_sm120=False,
                 is_blackwell=False, is_hopper_with_cuda_12_3=True, device_sm=90,
                 device_capability=(9, 0)),
    "b200": dict(is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False,
                 is_mps=False, has_amx=False, has_flashinfer=True, is_sm90=False,
                 is_sm100=True, is_sm100_or_sm110=True, is_sm110=False, is_sm120=False,
                 is_blackwell=True, is_hopper_with_cuda_12_3=False, device_sm=100,
                 device_capability=(10, 0)),
}

REPORT_FIELDS = [
    "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "max_running_requests",
    # context, useful to see why a rule fired
    "device", "attention_backend", "speculative_draft_attention_backend", "page_size",
    "tp_size", "context_length", "disable_overlap_schedule",
    "speculative_draft_model_revision", "speculative_attention_mode",
    "chat_template", "reasoning_parser",
]
SPEC_FIELDS = {"speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
               "speculative_num_draft_tokens", "max_running_requests",
               "speculative_draft_model_path"}


def strip_launcher(argv: list[str]) -> list[str]:
    """Drop `python -m sglang.launch_server` / `sglang serve` prefixes."""
    argv = list(argv)
    while argv and (argv[0].endswith(("python", "python3")) or argv[0] == "-m"
                    or argv[0] in ("sglang.launch_server", "sglang", "serve")):
        argv.pop(0)
    return argv


def _load_config(spec: str) -> dict:
    if spec in PRESETS:
        return PRESETS[spec]
    with open(spec) as f:
        return json.load(f)


def _flag_value(argv, names):
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if a.startswith(n + "="):
                return i, a  # rewritten below
    return None, None


def _substitute_path(argv, names, preset, tmp, label, mapping):
    idx, val = _flag_value(argv, names)
    if idx is None:
        return
    if "=" in argv[idx] and argv[idx].startswith("--"):
        flag, val = argv[idx].split("=", 1)
        argv[idx:idx + 1] = [flag, val]
        idx += 1
    if os.path.exists(os.path.join(val, "config.json")):
        return
    d = os.path.join(tmp, label)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(_load_config(preset), f)
    mapping[d] = val
    argv[idx] = d


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        if record.name.startswith("sglang.srt.arg_groups"):
            self.records.append(f"{record.name.rsplit('.', 1)[-1]}: {record.getMessage()}")


def parse(argv: list[str], platform: str = "h100", target_config: str = "llama",
          draft_config: str = "eagle3", backends: bool = False) -> dict:
    """Run SGLang's parser + resolution on `argv`; return the resolved fields.

    Raises whatever SGLang raises (ValueError/AssertionError/TypeError...) when
    SGLang rejects the arguments.  One call per ServerArgs record; safe to call
    repeatedly in one process (platform override is scoped). `backends`: also build
    the target's and the draft worker's attention backends with SGLang's ModelRunner
    code (draft_runner.py), under the same platform; answered in out["backends"]."""
    sglang_cpu.install_torchvision_stub()
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    argv = strip_launcher(argv)
    if not any(a == "--device" or a.startswith("--device=") for a in argv):
        argv += ["--device", "cpu" if platform == "cpu" else "cuda"]
    mapping: dict[str, str] = {}
    collector = _Collect()
    with tempfile.TemporaryDirectory(prefix="sgl_standin_") as tmp, \
            (override_platform(**PLATFORMS[platform]) if PLATFORMS[platform]
             else contextlib.nullcontext()):
        _substitute_path(argv, ["--model-path", "--model"], target_config, tmp,
                         "target", mapping)
        _substitute_path(argv, ["--speculative-draft-model-path",
                                "--speculative-draft-model"], draft_config, tmp,
                         "draft", mapping)
        server_args = prepare_server_args(argv)  # server_args.py:668
        logging.getLogger().addHandler(collector)
        try:
            server_args.resolve_once()  # server_args.py:244
        finally:
            logging.getLogger().removeHandler(collector)
        out = {}
        for f in REPORT_FIELDS:
            v = resolution_result(server_args, f)
            out[f] = mapping.get(v, v) if isinstance(v, str) else v
        out["_rules"] = [
            (src, {k: (mapping.get(v, v) if isinstance(v, str) else v)
                   for k, v in fields.items() if k in SPEC_FIELDS})
            for src, fields in server_args._resolved_overrides
            if SPEC_FIELDS & set(fields)
        ]
        out["_log"] = collector.records
        out["_stand_ins"] = {v: k for k, v in mapping.items()}
        if backends:
            import draft_runner

            out["backends"] = draft_runner.attention_backends(server_args)
    return out


def parse_or_error(case: dict) -> dict:
    try:
        return parse(list(case["argv"]), case.get("platform", "h100"),
                     case.get("target_config", "llama"), case.get("draft_config", "eagle3"),
                     case.get("backends", False))
    except (Exception, SystemExit) as e:  # SGLang rejected the arguments (argparse exits)
        return {"error": type(e).__name__, "message": str(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--platform", choices=sorted(PLATFORMS), default="h100")
    ap.add_argument("--target-config", default="llama",
                    help="preset (llama, deepseek_v3) or a config.json path, used "
                         "only when --model-path has no config.json here")
    ap.add_argument("--draft-config", default="eagle3")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", help="a JSON file of cases; prints a JSON list of answers")
    ap.add_argument("server_argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.cases:
        with open(a.cases) as f:
            cases = json.load(f)
        print(json.dumps([parse_or_error(c) for c in cases], default=str))
        return
    server_argv = a.server_argv[1:] if a.server_argv[:1] == ["--"] else a.server_argv
    logging.disable(logging.NOTSET)
    try:
        res = parse(server_argv, a.platform, a.target_config, a.draft_config)
    except Exception as e:  # SGLang rejected the arguments
        msg = {"error": type(e).__name__, "message": str(e)}
        print(json.dumps(msg) if a.json else f"REJECTED {msg['error']}: {msg['message']}")
        sys.exit(2)
    if a.json:
        print(json.dumps(res, default=str))
        return
    print(f"platform={a.platform}")
    for k in ["speculative_algorithm", "speculative_draft_model_path",
              "speculative_num_steps", "speculative_eagle_topk",
              "speculative_num_draft_tokens", "max_running_requests"]:
        print(f"{k}={res[k]}")
    print("-- context: " + ", ".join(f"{k}={res[k]}" for k in REPORT_FIELDS[6:]))
    print("-- spec-relevant declarations (rule -> fields):")
    for src, fields in res["_rules"]:
        print(f"   {src}: {fields}")
    print("-- resolution log (arg_groups):")
    for line in res["_log"]:
        print(f"   {line}")
    if res["_stand_ins"]:
        print(f"-- stand-in config dirs used for: {sorted(res['_stand_ins'])}")


if __name__ == "__main__":
    main()
