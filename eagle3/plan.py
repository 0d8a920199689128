"""What a config will do and cost, and whether it can start, before a GPU node is booked.

    python -m eagle3.plan configs/kimi-k2.5.yaml [section.key=value ...]
    bash run_pipeline.sh configs/kimi-k2.5.yaml --plan

Prints, per stage, the work (prompts, estimated tokens from the data and
`generate.max_new_tokens`), the disk it writes (hidden states per storage dtype), the training
memory per GPU (weights, gradients, AdamW moments, and the activations of one micro-batch
from the measured fit in `memory_fit.json`; DDP and FSDP), the engine commands the stages
will run, and hours on `plan.gpus` GPUs from the throughput figures in the `plan` section (left
out where a figure is unset). Then the preflight checks, one verdict per line; any FAIL makes
it exit 2. Nothing is started or written. When the verifier is not on this machine, its shape comes from
`plan.verifier_config` (a copy of its config.json).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from eagle3.bench import served_beyond_trained
from eagle3.config import (Config, ConfigError, ServerConfig, VerifierInfo, load_config,
                           read_verifier_info, sglang_engine_problem, sglang_sampling_problem)
from eagle3.cpu import cpu_verdicts, features
from eagle3.runs import StageError

GB = 1e9
THINKING = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]


@dataclasses.dataclass
class Verdict:
    check: str
    ok: Optional[bool]
    """True pass, False fail, None not checked here (with the reason in `detail`)."""
    detail: str

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[self.ok]
        return f"  [{mark}] {self.check}: {self.detail}"


def verifier_facts(cfg: Config) -> tuple[Optional[VerifierInfo], str]:
    """The verifier's shape, from verifier.path or else `plan.verifier_config`."""
    try:
        return cfg.verifier_info, str(cfg.verifier_path)
    except ConfigError as e:
        if not cfg.plan.verifier_config:
            return None, str(e)
        copy = dataclasses.replace(cfg.verifier, path=cfg.plan.verifier_config)
        return read_verifier_info(copy), f"{cfg.plan.verifier_config} (verifier not here)"


def _tokens_per_char(cfg: Config) -> tuple[float, str]:
    try:
        from eagle3.verifier import load_tokenizer
        tok = load_tokenizer(cfg)
    except StageError:
        return 0.25, "4 characters per token assumed (tokenizer not here)"
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "Résumé, 数据, 1234567."
    return len(tok(text, add_special_tokens=False)["input_ids"]) / len(text), "verifier tokenizer"


def data_estimate(cfg: Config) -> dict[str, Any]:
    """Prompts, turns and tokens of stage 01's selection (sources read, answers estimated)."""
    from eagle3.data import load_prompts

    prompts = load_prompts(cfg.data, unreachable_ok=True)
    rows = prompts.rows
    per_char, how = _tokens_per_char(cfg)
    answer = cfg.plan.answer_fraction * cfg.generate.max_new_tokens
    turns = [sum(m["role"] == "user" for m in r["messages"]) for r in rows]
    prompt_chars = [sum(len(m["content"]) for m in r["messages"]) for r in rows]
    tokens = [min(c * per_char + t * (answer + 16), cfg.data.max_seq_len)
              for c, t in zip(prompt_chars, turns)]
    # Sources not reachable here: their prompts count as the reachable ones' mean (one turn
    # and half the longest sample when nothing was read).
    mean_turns = sum(turns) / len(turns) if turns else 1.0
    mean_tokens = sum(tokens) / len(tokens) if tokens else cfg.data.max_seq_len / 2
    n = len(rows) + prompts.assumed
    all_turns = sum(turns) + prompts.assumed * mean_turns
    out = {"prompts": n, "turns": round(all_turns), "answer_tokens": answer,
           "answer_source": f"{cfg.plan.answer_fraction} x max_new_tokens",
           "generated_tokens": all_turns * answer,
           "tokens": sum(tokens) + prompts.assumed * mean_tokens,
           "tokens_max": n * cfg.data.max_seq_len, "token_source": how,
           "assumed": prompts.assumed,
           "per_source": {name: (st["usable"], st["selected"])
                          for name, st in prompts.stats.items()}}
    return {**out, **stage01_measured(cfg)}


def stage01_measured(cfg: Config) -> dict[str, Any]:
    """What this run's stage 01 measured, where it finished with this config: the answers the
    verifier really gave and the samples' real tokens, which decide stage 02's disk and the
    store / stream choice (the estimate assumes answers of `plan.answer_fraction` x
    max_new_tokens; the quality config's ran 1.8x longer)."""
    from eagle3.runs import Stage

    stage = Stage(cfg, 1)
    manifest = stage.manifest() if stage.is_done() else {}
    counts = manifest.get("counts", {})
    if not counts.get("samples") or not {"generated_tokens", "tokens", "turns"} <= set(counts) \
            or stage.changes(manifest):
        return {}  # not run, run with another config, or a manifest without these counts
    turns = counts["samples"] * counts["turns"]["mean"]
    return {"turns": round(turns), "answer_tokens": counts["generated_tokens"] / turns,
            "answer_source": "measured by stage 01", "generated_tokens":
            counts["generated_tokens"], "tokens": counts["tokens"],
            "token_source": f"measured by stage 01, {counts['samples']} samples"}


def verifier_loads(cfg: Config) -> dict[str, int]:
    """How many times each stage loads the verifier (an engine start or an in-process load):
    on a Kimi node each costs 20-30 minutes before any work."""
    generate = 0 if cfg.generate.engine != "hf" and cfg.generate.server_urls else 1
    extract = 0 if cfg.hidden_states.backend == "vllm" and cfg.hidden_states.server_urls else 1
    if cfg.measures_base and cfg.hidden_states.backend == "vllm":
        extract += 1  # the measure set's layers are captured by a second server
    # stream mode: stage 04 runs the verifier too (each rank in-process, or a capture server)
    train = 0 if cfg.hidden_states.mode == "store" or (
        cfg.hidden_states.backend == "vllm" and cfg.hidden_states.server_urls) else 1
    bench = 0
    for engine in cfg.bench.engines:
        if engine.name == "hf":
            bench += 1  # the reference decoder loads it once, in-process
        else:
            bench += len(engine.parsed_depths) + int(engine.serves_baseline)
    return {"01": generate, "02": extract, "04": train, "06": bench}


def hidden_state_bytes(info: VerifierInfo, tokens: float) -> dict[str, float]:
    from eagle3.shards import STORAGE, bytes_per_token
    return {dtype: tokens * bytes_per_token(len(info.aux_layer_ids), info.hidden_size, dtype)
            for dtype in STORAGE}


MEMORY_FIT = Path(__file__).with_name("memory_fit.json")
"""Stage 04's activation memory as measured by `bench/bench_memory.py fit` (which writes this
file; bench/RESULTS.md "Training memory" shows the runs)."""
GPU_HEADROOM = 0.9
"""Of `plan.gpu_memory_gb`, what the plan lets stage 04 use: the rest is for the CUDA context,
NCCL buffers and the caching allocator's fragmentation."""


def activation_bytes(fit: dict[str, Any], shape: Any, steps: int, tokens: int) -> float:
    """Peak bytes of one micro-batch of `tokens` tokens beyond the model states: the fitted
    transient (attention blocks of a bounded size, whatever the lengths) and per-token-and-step
    terms, the teacher's float32 draft-vocabulary logits and the micro-batch's float32 states
    (both per token). Attention keeps no [L, L] tensor, so document lengths do not enter. An MLA
    layer's head_dim is qk_nope + qk_rope, the width its q/k/v are padded to for the fused
    attention, so the attention term reads the same; its low-rank latents (about 4k values per
    token at Kimi's shape, under 5% of the per-token activations) are left out. Measured
    (bench/bench_memory.py mla, bench/RESULTS.md): an MLA layer keeps 3-11% less than the MHA
    layer of the same heads and widths, and this reads it within -1% to +27%."""
    c = fit["per_token_step"]
    per_token_step = (c["const"] + c["draft_vocab"] * shape.draft_vocab_size
                      + c["hidden"] * shape.hidden_size + c["intermediate"]
                      * shape.intermediate_size + c["attention"] * shape.num_attention_heads
                      * shape.head_dim)
    per_token = 4 * shape.draft_vocab_size + 4 * (shape.num_aux + 1) * shape.target_hidden_size
    return fit["transient_bytes"] + tokens * (steps * per_token_step + per_token)


def training_memory(cfg: Config, info: VerifierInfo, tokens: Optional[int] = None
                    ) -> dict[str, Any]:
    """Bytes per GPU: model states plus the activations of one micro-batch of `tokens`
    (default `train.batch_tokens`), from `MEMORY_FIT`. Model states: fp32 weights, grads and AdamW
    moments of the trainable parameters (16 B each; sharded over the GPUs under FSDP, which
    gathers the full fp32 weights for forward and backward, 4 B), DDP's gradient buckets (4 B),
    autocast's bf16 weight copies (2 B), the frozen embedding and the teacher's lm_head (fp32)."""
    import json

    import torch

    from eagle3.model import Eagle3DraftModel
    from eagle3.train import draft_model_config

    tc = cfg.train
    vd = cfg.vocab.size_for(info.vocab_size)
    shape = draft_model_config(cfg, info.vocab_size, vd, info)
    with torch.device("meta"):
        model = Eagle3DraftModel(shape)
    trainable = sum(p.numel() for n, p in model.named_parameters()
                    if not n.startswith("embed_tokens"))
    # embedding + the teacher's head in fp32, and its draft rows (`VerifierHead`: a copy for a
    # reduced vocabulary, the head itself for the full one)
    frozen = 4 * info.hidden_size * (2 * info.vocab_size + (0 if shape.full_vocab else vd))
    states = {"ddp": 22 * trainable + frozen,
              "fsdp": 16 * trainable / cfg.plan.gpus + 6 * trainable + frozen,
              "none": 18 * trainable + frozen}  # one process: no gradient buckets
    out: dict[str, Any] = {"trainable_parameters": trainable, **states}
    if not MEMORY_FIT.exists():
        return out
    fits = json.loads(MEMORY_FIT.read_text())
    mode = "checkpointed" if tc.activation_checkpointing else "plain"
    tokens = tokens or tc.batch_tokens
    act = {m: activation_bytes(fits[m], shape, tc.ttt_steps, tokens)
           for m in ("plain", "checkpointed")}
    out.update(activations=act[mode], activations_other=act["checkpointed" if mode == "plain"
                                                             else "plain"],
               checkpointing=mode == "checkpointed", fit_source=fits.get("measured", "?"))
    out["peak"] = {k: v + act[mode] for k, v in states.items()}
    if cfg.plan.gpu_memory_gb:
        budget = cfg.plan.gpu_memory_gb * GB * GPU_HEADROOM
        per_token = (act[mode] - fits[mode]["transient_bytes"]) / tokens
        out["max_batch_tokens"] = {
            k: max(int((budget - v - fits[mode]["transient_bytes"]) / per_token), 0)
            for k, v in states.items()}
    return out


def memory_lines(cfg: Config, mem: dict[str, Any]) -> list[str]:
    """The plan's lines on stage 04's memory per GPU."""
    if "activations" not in mem:
        return [f"   activations: not predicted ({MEMORY_FIT.name} missing: run "
                f"bench/bench_memory.py fit)"]
    tc, other = cfg.train, "on" if not mem["checkpointing"] else "off"
    lines = [f"   activations at train.batch_tokens={tc.batch_tokens} (any document lengths: "
             f"attention keeps no [L, L] tensor), TTT {tc.ttt_steps}, "
             f"activation checkpointing {'on' if mem['checkpointing'] else 'off'}: "
             f"{mem['activations'] / GB:.1f} GB ({mem['activations_other'] / GB:.1f} GB with it "
             f"{other}; fit measured {mem['fit_source']})",
             f"   peak per GPU: {mem['peak']['ddp'] / GB:.1f} GB under DDP, "
             f"{mem['peak']['fsdp'] / GB:.1f} GB under FSDP (train.parallel={tc.parallel})"]
    if "max_batch_tokens" in mem:
        lines.append(f"   largest train.batch_tokens within {GPU_HEADROOM:.0%} of "
                     f"plan.gpu_memory_gb={cfg.plan.gpu_memory_gb:g}: "
                     f"{mem['max_batch_tokens']['ddp']} under DDP, "
                     f"{mem['max_batch_tokens']['fsdp']} under FSDP")
    return lines


def memory_verdict(cfg: Config, mem: dict[str, Any]) -> Verdict:
    check = "stage 04 memory per GPU"
    if not cfg.plan.gpu_memory_gb:
        return Verdict(check, None, "plan.gpu_memory_gb unset")
    if "peak" not in mem:
        return Verdict(check, None, f"{MEMORY_FIT.name} missing")
    peak = mem["peak"][cfg.train.parallel]
    budget = cfg.plan.gpu_memory_gb * GB * GPU_HEADROOM
    detail = (f"{peak / GB:.0f} GB predicted under {cfg.train.parallel}, "
              f"{budget / GB:.0f} GB usable ({GPU_HEADROOM:.0%} of "
              f"plan.gpu_memory_gb={cfg.plan.gpu_memory_gb:g})")
    if peak <= budget:
        return Verdict(check, True, detail)
    fixes = [f"train.batch_tokens<={mem['max_batch_tokens'][cfg.train.parallel]}"]
    if not mem["checkpointing"]:
        fixes.append("train.activation_checkpointing=true")
    if cfg.train.parallel == "ddp" and mem["peak"]["fsdp"] < peak:
        fixes.append("train.parallel=fsdp")
    return Verdict(check, False, f"{detail}: set {' or '.join(fixes)}")


def gpu_verdict(cfg: Config) -> Verdict:
    """`train.device=cuda`: this machine's torch must see the GPUs of `plan.gpus`."""
    import torch

    from eagle3.dist import cuda_shortfall
    check = "GPUs for stage 04"
    if cfg.train.device != "cuda":
        return Verdict(check, None, f"train.device={cfg.train.device}")
    why = cuda_shortfall(cfg.plan.gpus)
    if why:
        return Verdict(check, False, f"plan.gpus={cfg.plan.gpus}: {why}")
    return Verdict(check, True, f"{torch.cuda.device_count()} visible, plan.gpus="
                                f"{cfg.plan.gpus}, torch {torch.__version__}")


def engine_commands(cfg: Config) -> dict[str, list[str]]:
    from eagle3.bench import engine_args
    from eagle3.engines import server_command
    from eagle3.hidden_states import vllm_layer_ids, vllm_server_args

    out = {}
    if cfg.generate.engine != "hf" and not cfg.generate.server_urls:
        out["01 generate"] = server_command(
            cfg.generate.engine, cfg, cfg.generate.server, str(cfg.verifier_path), 8000,
            cfg.generate.server.max_model_len or cfg.data.max_seq_len + cfg.generate.max_new_tokens,
            [])
    info, _ = verifier_facts(cfg)
    if cfg.hidden_states.backend == "vllm" and not cfg.hidden_states.server_urls and info:
        ids = vllm_layer_ids(list(info.aux_layer_ids), info.num_hidden_layers)
        out["02 extract"] = server_command(
            "vllm", cfg, cfg.hidden_states.server, str(cfg.verifier_path), 8001,
            cfg.hidden_states.server.max_model_len or cfg.data.max_seq_len + 1,
            vllm_server_args(ids, cfg.run_dir / "02_hidden_states" / ".vllm_hidden_states"))
    for engine in cfg.bench.engines:  # the first depth of each engine: the deepest, by habit
        if engine.name == "hf":  # the reference decoder runs in-process, no server
            continue
        depth = engine.parsed_depths[0]
        out[f"06 bench {engine.name} {depth.label}"] = server_command(
            engine.name, cfg, engine.server, str(cfg.verifier_path), 8002,
            engine.server.max_model_len or 2048,
            engine_args(engine, depth, cfg.run_dir / "05_export" / engine.name,
                        max(cfg.bench.concurrency)))
    return out


def free_disk(cfg: Config) -> tuple[int, Path]:
    """Free bytes on the disk that will hold the run directory, and where that was measured."""
    probe = cfg.run_dir
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def store_or_stream(cfg: Config, info: VerifierInfo, tokens: float, stored_bytes: float,
                    free: tuple[int, Path]) -> dict[str, Any]:
    """The hidden-state trade-off (`hidden_states.mode`): storing pays the disk and one verifier
    pass; streaming pays a verifier pass per epoch (over the training tokens, plus the
    validation set at each checkpoint, left out here) and a bounded buffer per rank. Returns
    the plan's lines and the bytes each mode puts on the disk."""
    from eagle3.shards import bytes_per_token

    hs, p, epochs = cfg.hidden_states, cfg.plan, cfg.train.epochs
    bpt = bytes_per_token(len(info.aux_layer_ids), info.hidden_size, hs.dtype)
    ranks = p.gpus if cfg.train.device != "cpu" else 1
    buffer = hs.stream_ahead * cfg.train.batch_tokens * bpt * ranks
    # Only the reference samples go to the disk in stream mode; the buffer is memory (the
    # in-process producer) or transient engine files consumed as they are trained on.
    reference = hs.check_samples * cfg.data.max_seq_len * bpt
    once = tokens / p.extract_tok_s / 3600 if p.extract_tok_s else None
    hours = (lambda n: _verifier_time(n * once)) if once is not None else (
        lambda n: f"{n:g} verifier pass{'es' if n != 1 else ''} over the data "
                  f"(set plan.extract_tok_s for hours)")
    lines = [f"   store or stream ({cfg.train.epochs} epochs, {ranks} training rank(s); "
             f"hidden_states.mode={hs.mode}):",
             f"     store : {_disk(stored_bytes)} on disk, {hours(1)}",
             f"     stream: {_disk(reference)} on disk, {hours(epochs)}, states in flight "
             f"{buffer / GB:.2f} GB at most ({hs.stream_ahead} micro-batches of "
             f"{cfg.train.batch_tokens} tokens per rank, hidden_states.stream_ahead)"]
    if hs.cache_gb > 0:
        kept = min(hs.cache_gb * 1e9 / stored_bytes, 1.0) if stored_bytes else 1.0
        passes = 1 + (epochs - 1) * (1 - kept)
        lines.append(f"     cache : {_disk(min(hs.cache_gb * 1e9, stored_bytes))} on disk "
                     f"(hidden_states.cache_gb={hs.cache_gb:g}: {kept:.0%} of the states), "
                     f"{hours(round(passes, 2))}")
    free_bytes, where = free
    if stored_bytes * 1.1 > free_bytes:
        best = f"stream: storing needs {stored_bytes * 1.1 / 1e12:.2f} TB with its margin, " \
               f"{free_bytes / 1e12:.2f} TB is free at {where}"
    elif epochs > 1:
        best = f"store: it saves {hours(epochs - 1)} for {_disk(stored_bytes).strip()} of disk"
    else:
        best = "stream: one epoch passes the verifier over the data once either way, and " \
               "streaming keeps the disk free"
    lines.append(f"     cheaper here: {best}")
    return {"lines": lines, "disk": {"store": stored_bytes, "stream": reference},
            "cheaper": best.split(":")[0]}


def _disk(size: float) -> str:
    """Terabytes at a node's scale, gigabytes below (a demo's states are a few GB)."""
    return f"{size / 1e12:8.3f} TB" if size >= 1e12 else f"{size / 1e9:8.3f} GB"


def _verifier_time(hours: float) -> str:
    return f"{hours:.1f} verifier hours" if hours >= 1 else f"{hours * 60:.1f} verifier minutes"


def _hours(work: float, rate: Optional[float]) -> str:
    return f"{work / rate / 3600:.1f} h" if rate else "(set the plan section's rate for hours)"


def _engine_version(python: str, module: str) -> Verdict:
    try:
        out = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Verdict(f"{module} importable by {python}", False, str(e))
    ok = out.returncode == 0
    detail = out.stdout.strip() if ok else (out.stderr.strip().splitlines() or ["?"])[-1]
    return Verdict(f"{module} importable by {python}", ok, detail[:160])


def engine_python(server: ServerConfig) -> Optional[str]:
    """The Python an engine server runs in: `server.python`, the interpreter a `command`
    starts (itself, or the one its console script's #! line names), or ours by default; None
    when a command's interpreter cannot be told."""
    if not server.command:
        return server.python or sys.executable
    exe = shutil.which(server.command[0])
    if exe is None:
        return None
    if Path(exe).name.startswith("python"):
        return exe
    try:
        with open(exe, "rb") as f:
            first = f.readline(300).decode("utf-8", "replace")
    except OSError:
        return None
    shebang = first[2:].split() if first.startswith("#!") else []
    return shebang[0] if shebang and "python" in Path(shebang[0]).name else None


_ENGINE_TOKENIZER = """
import sys, transformers
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == "1")
print(type(tok).__name__, "under transformers", transformers.__version__)
"""


def _engine_tokenizer_verdict(cfg: Config, module: str, python: str) -> Verdict:
    """The engine loads the verifier's tokenizer (remote code included) with its own
    transformers, which may not be ours: an import that version lacks would otherwise fail
    only once the server starts, after a 20-30 minute load."""
    name = f"verifier tokenizer in {module}'s Python ({python})"
    if not cfg.verifier_path.is_dir():
        return Verdict(name, None, f"verifier.path {cfg.verifier_path} not here")
    try:
        out = subprocess.run([python, "-c", _ENGINE_TOKENIZER, str(cfg.verifier_path),
                              "1" if cfg.verifier.trust_remote_code else "0"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return Verdict(name, False, str(e)[:200])
    if out.returncode == 0:
        return Verdict(name, True, out.stdout.strip()[:160])
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()] or ["?"]
    error = lines[-1].strip()
    if "requires the following packages" in error:
        hint = f"; install them with {python} -m pip"
    elif "cannot import name" in error:
        hint = ("; the verifier's tokenizer code imports what this transformers lacks: use "
                "the verifier snapshot's newer tokenizer code, or a transformers the code "
                "supports, in that environment")
    else:
        hint = ""
    return Verdict(name, False, error[:200] + hint)


def preflight(cfg: Config, needed_bytes: float) -> list[Verdict]:
    """One verdict per check that can run without a GPU."""
    verdicts = []
    try:
        info = cfg.verifier_info
        verdicts.append(Verdict("verifier config", True, f"{info.architecture}, "
                                f"{info.num_hidden_layers} layers, hidden {info.hidden_size}"))
        verdicts.append(Verdict("aux ids in range", True, f"{list(info.aux_layer_ids)} of "
                                f"1..{info.num_hidden_layers}"))
    except ConfigError as e:
        verdicts.append(Verdict("verifier config", False, str(e)))
    verdicts.append(_tokenizer_verdict(cfg))
    if cfg.hidden_states.backend == "vllm":
        verdicts.append(_final_norm_verdict(cfg))
    verdicts.append(_base_verdict(cfg))
    verdicts.append(_init_verdict(cfg))
    free, probe = free_disk(cfg)
    verdicts.append(Verdict("free disk for hidden states", free >= needed_bytes * 1.1,
                            f"{free / GB:.0f} GB free at {probe}, "
                            f"{needed_bytes * 1.1 / GB:.0f} GB needed"
                            + (" (stream mode)" if cfg.hidden_states.mode == "stream" else "")))
    engines = {("vllm" if cfg.generate.engine == "vllm" else "sglang"): cfg.generate.server
               } if cfg.generate.engine != "hf" else {}
    if cfg.hidden_states.backend == "vllm":
        engines.setdefault("vllm", cfg.hidden_states.server)
    for engine in cfg.bench.engines:
        if engine.name != "hf":
            engines.setdefault(engine.name, engine.server)
    checked: set[str] = set()  # Pythons whose tokenizer load was checked
    for module, server in engines.items():
        if server.command:
            found = shutil.which(server.command[0])
            verdicts.append(Verdict(f"{server.command[0]} on PATH", found is not None,
                                    found or "not found"))
        else:
            verdicts.append(_engine_version(server.python or sys.executable, module))
        python = engine_python(server)
        if python is not None and python not in checked:
            checked.add(python)
            verdicts.append(_engine_tokenizer_verdict(cfg, module, python))
    verdicts.append(gpu_verdict(cfg))
    verdicts += [Verdict(*v) for v in cpu_verdicts(cfg)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        verdicts.append(Verdict("a local port for engine servers", True,
                                f"127.0.0.1:{s.getsockname()[1]} bindable"))
    return verdicts


def _tokenizer_verdict(cfg: Config) -> Verdict:
    from eagle3.data import render
    from eagle3.verifier import load_tokenizer
    try:
        tok = load_tokenizer(cfg)
        text = render(tok, THINKING, add_generation_prompt=False)
    except StageError as e:
        return Verdict("tokenizer + chat template", False, str(e)[:200])
    kind = f"{type(tok).__name__} ({'fast' if tok.is_fast else 'slow'})"
    if "Add them." in text:
        return Verdict("tokenizer + chat template", True,
                       f"{kind}, thinking conversation: reasoning rendered")
    if not any(word in tok.chat_template for word in ("reasoning", "think")):
        # A template with no notion of reasoning belongs to a verifier that writes none: a
        # failure here would be a false alarm (stage 02 still refuses any sample whose
        # reasoning the template drops).
        return Verdict("tokenizer + chat template", None,
                       f"{kind}; the template has no reasoning field: fine for a verifier that "
                       f"does not think")
    return Verdict("tokenizer + chat template", False,
                   f"{kind}, thinking conversation: reasoning NOT rendered; set "
                   f"verifier.chat_template to a template that renders reasoning_content")


def _final_norm_verdict(cfg: Config) -> Verdict:
    """Stage 02's vllm backend post-norms the last captured state with the verifier's own norm
    class (`verifier.load_final_norm`): the decoder built on the meta device through the
    verifier's (remote) code, one small tensor read. Checked here so that a remote-code import
    this transformers lacks fails now, not when stage 02 starts after stage 01's hours."""
    from eagle3.verifier import load_final_norm
    if not cfg.verifier_path.is_dir():
        return Verdict("verifier final norm (stage 02, vllm)", False,
                       f"verifier.path {cfg.verifier_path} is not a directory")
    try:
        norm = load_final_norm(cfg.verifier_path, cfg.verifier.dtype,
                               cfg.verifier.trust_remote_code)
    except StageError as e:
        return Verdict("verifier final norm (stage 02, vllm)", False, str(e)[:200])
    except Exception as e:  # noqa: BLE001 - remote code can raise anything; name it
        first = (str(e).strip().splitlines() or [""])[0]
        return Verdict("verifier final norm (stage 02, vllm)", False,
                       f"building the verifier's decoder failed: {type(e).__name__}: "
                       f"{first[:160]}")
    return Verdict("verifier final norm (stage 02, vllm)", True, type(norm).__name__)


def _base_verdict(cfg: Config) -> Verdict:
    if not cfg.train.finetune_from:
        return Verdict("base drafter shape", None, "no train.finetune_from")
    if not Path(cfg.train.finetune_from).expanduser().is_dir():
        return Verdict("base drafter shape", None, f"{cfg.train.finetune_from} not here")
    from eagle3 import base_drafter
    from eagle3.train import draft_model_config
    try:
        base = base_drafter.load(cfg.train.finetune_from)
        ours = draft_model_config(cfg, base.shape.vocab_size, base.shape.draft_vocab_size)
        fields = ("attention", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "num_layers", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        diffs = [f"{k} {getattr(base.shape, k)} vs ours {getattr(ours, k)}" for k in fields
                 if getattr(base.shape, k) != getattr(ours, k)]
    except (StageError, ConfigError) as e:
        return Verdict("base drafter shape", False, str(e)[:200])
    return Verdict("base drafter shape", not diffs, "; ".join(diffs) or "equal to ours")


def _init_verdict(cfg: Config) -> Verdict:
    if cfg.train.init_layer == "random":
        return Verdict("drafter init from a verifier layer", None, "train.init_layer=random")
    import torch
    from eagle3.model import Eagle3DraftModel
    from eagle3.train import draft_model_config, init_from_verifier_layer
    try:
        info = cfg.verifier_info
        with torch.device("meta"):
            model = Eagle3DraftModel(draft_model_config(
                cfg, info.vocab_size, cfg.vocab.size_for(info.vocab_size)))
        init_from_verifier_layer(model, cfg.verifier_path, info, check_only=True)
    except (StageError, ConfigError) as e:
        return Verdict("drafter init from a verifier layer", False, str(e)[:200])
    return Verdict("drafter init from a verifier layer", True,
                   f"layer {info.aux_layer_ids[-1]}: every shape equal to the drafter's")


def render_plan(cfg: Config) -> tuple[str, list[Verdict]]:
    """The plan's text, and its preflight verdicts (a failed one makes `main` exit 2)."""
    info, source = verifier_facts(cfg)
    if info is None:
        raise ConfigError(f"{source}; to plan without the verifier, set plan.verifier_config "
                          f"to a copy of its config.json")
    d, p = data_estimate(cfg), cfg.plan
    disk = hidden_state_bytes(info, d["tokens"])
    disk_max = hidden_state_bytes(info, d["tokens_max"])
    mem = training_memory(cfg, info)
    train_tokens = d["tokens"] * (1 - cfg.train.val_fraction) * cfg.train.epochs
    lines = [f"plan for {cfg.source} (run {cfg.run_dir}); verifier shape from {source}",
             f"  this machine: {features().summary()} (what it can run: preflight below)",
             f"  {info.architecture}: {info.num_hidden_layers} layers, hidden {info.hidden_size}, "
             f"vocab {info.vocab_size}, aux ids {list(info.aux_layer_ids)}", "",
             f"verifier loads: {_loads_line(cfg)}", "",
             f"01 generate: {d['prompts']} prompts"
             + (f" (of data.num_samples={cfg.data.num_samples}: the sources have no more)"
                if d["prompts"] < cfg.data.num_samples else "")
             + f", {d['turns']} turns, ~{d['answer_tokens']:.0f} "
             f"tokens per answer ({d['answer_source']}), ~"
             f"{d['generated_tokens'] / 1e6:.1f}M generated tokens: "
             f"{_hours(d['generated_tokens'], p.generate_tok_s)}",
             f"   per source (usable / taken): " + ", ".join(
                 f"{name} {'? (not reachable here)' if usable is None else usable} / {taken}"
                 for name, (usable, taken) in d["per_source"].items())
             + (f"; {d['assumed']} prompts of unreachable hub sources estimated like the rest"
                if d["assumed"] else ""),
             f"   samples ~{d['tokens'] / 1e6:.1f}M tokens (at most {d['tokens_max'] / 1e6:.1f}M"
             f"; {d['token_source']})",
             f"02 extract: ~{d['tokens'] / 1e6:.1f}M tokens: "
             f"{_hours(d['tokens'], p.extract_tok_s)}"]
    for dtype, nbytes in disk.items():
        lines.append(f"   hidden states as {dtype}: ~{_disk(nbytes).strip()} (at most "
                     f"{_disk(disk_max[dtype]).strip()})")
    choice = store_or_stream(cfg, info, d["tokens"], disk[cfg.hidden_states.dtype],
                             free_disk(cfg))
    lines += choice["lines"]
    lines += [f"04 train: {mem['trainable_parameters'] / 1e9:.2f}B trainable parameters; model "
              f"states per GPU {mem['ddp'] / GB:.1f} GB under DDP, {mem['fsdp'] / GB:.1f} GB under "
              f"FSDP over {p.gpus} GPUs; {cfg.train.epochs} epochs ~"
              f"{train_tokens / 1e6:.1f}M tokens: "
              f"{_hours(train_tokens, (p.train_tok_s_per_gpu or 0) * p.gpus)}",
              *memory_lines(cfg, mem),
              f"   checkpoints: ~{mem['trainable_parameters'] * 16 * (cfg.train.keep + 1) / GB:.0f}"
              f" GB ({cfg.train.keep} kept + best, weights and AdamW moments)"]
    note = served_beyond_trained(cfg)
    lines += [f"   note: {note}"] if note else []
    lines += _proposals(cfg, disk, d)
    lines += ["", "engine commands (port numbers are chosen at run time):"]
    lines += [f"  {name}: {' '.join(cmd)}" for name, cmd in engine_commands(cfg).items()]
    verdicts = (preflight(cfg, choice["disk"][cfg.hidden_states.mode])
                + [memory_verdict(cfg, mem)]
                + _sglang_backend_verdicts(cfg, info))
    lines += ["", "preflight:"] + [v.line() for v in verdicts]
    return "\n".join(lines), verdicts


def _sglang_backend_verdicts(cfg: Config, info: VerifierInfo) -> list[Verdict]:
    """Stage 06's SGLang drafter-backend rule, told at planning time (the verifier's shape may
    come from plan.verifier_config here)."""
    if not any(e.name == "sglang" for e in cfg.bench.engines):
        return []
    problem = sglang_engine_problem(cfg, info.mla)
    verdicts = [Verdict("sglang drafter attention backend", problem is None,
                        problem or "the drafter gets a backend it can run")]
    if any(e.name == "sglang" and e.draft_sample != "greedy" for e in cfg.bench.engines):
        if cfg.copies_base_vocab:  # the base drafter's map decides; stage 06 reads the export
            verdicts.append(Verdict("sglang draft sampling", None,
                                    "the base drafter's vocabulary decides (checked at stage 06)"))
        else:
            problem = sglang_sampling_problem(
                cfg, cfg.vocab.size_for(info.vocab_size) == info.vocab_size)
            verdicts.append(Verdict("sglang draft sampling", problem is None,
                                    problem or "a full draft vocabulary: SGLang samples drafts"))
    return verdicts


def _loads_line(cfg: Config) -> str:
    loads = verifier_loads(cfg)
    return (f"{sum(loads.values())} in all (" + ", ".join(
        f"stage {n}: {k}" for n, k in loads.items() if k or n != "04")
        + f"; stages 03{'' if loads['04'] else '-04'} and 05 none)")


def _proposals(cfg: Config, disk: dict[str, float], d: dict[str, Any]) -> list[str]:
    need = disk[cfg.hidden_states.dtype]
    if need < 1e12 or cfg.hidden_states.mode == "stream":
        return []
    per_sample = need / max(d["prompts"], 1)
    return [f"   !! {need / 1e12:.1f} TB of hidden states: consider hidden_states.dtype=fp8_e4m3 "
            f"({disk['fp8_e4m3'] / 1e12:.1f} TB), hidden_states.mode=stream (no data set on "
            f"disk), or a first run of data.num_samples={int(1e12 / per_sample)} (~1 TB) "
            f"before the full one"]


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        text, verdicts = render_plan(load_config(args.config, args.overrides))
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    failed = [v.check for v in verdicts if v.ok is False]
    if failed:  # scripts (and run_pipeline.sh users) must not read a failed plan as a pass
        print(f"error: the plan fails {len(failed)} check(s): {', '.join(failed)}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
