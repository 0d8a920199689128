"""Stage 04: training-time-test (TTT) training of the EAGLE-3 drafter, with exact resume.

    python 04_train.py configs/smollm2-135m-cpu.yaml [train.lr=3e-4] [--finetune-from DIR]
    torchrun --nproc-per-node 4 04_train.py CONFIG [train.parallel=fsdp]

The objective is `eagle3.ttt`. This module is the stage: `setup` (data, model, optimizer),
`resume` (the newest intact checkpoint), `train_step`, `validate`, `save` and `finish`,
composed by `run_train`. Data order is a pure function of (seed, epoch), so the resume point is
just (epoch, batch), and a killed run resumed equals an uninterrupted one bit for bit.

Before the first step the stage refuses samples whose supervised tokens do not fit
`train.batch_tokens` (they would train nothing). A non-finite loss or gradient stops training
at once, naming the step, its samples (and any sample whose stored states are not finite) and
the last good checkpoint; nothing non-finite is ever saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3 import base_drafter, dist
from eagle3 import checkpoint as ckpt
from eagle3.config import Config, ConfigError, VerifierInfo
from eagle3.formats import ExportContext, speculators_config
from eagle3.model import DraftModelConfig, Eagle3DraftModel
from eagle3.runs import (Stage, StageError, atomic_write_json, atomic_write_text,
                         and_more, clean_stale_tmp, config_changes, depends_on, is_rank0)
from eagle3.shards import HiddenStates, pack
from eagle3.stream import (STATE_CACHE, Producer, StateCache, StreamedStates, is_streamed,
                           open_streamed)
from eagle3.teacher import TeacherCache, VerifierHead
from eagle3.ttt import StepStats, TTTObjective, TTTSpec, prepare_batch, ttt_forward
from eagle3.verifier import lazy_tensor, load_lazy, read_tensor
from eagle3.vocab import load_vocab, remap_lm_head
from eagle3.weights_io import load as load_tensor

log = logging.getLogger("eagle3")


# ---------------------------------------------------------------------------------------------
# Data order


def epoch_batches(lengths: list[int], indices: list[int], budget: int, seed: int,
                  epoch: int) -> list[list[int]]:
    order = list(indices)
    random.Random(seed * 1000003 + epoch).shuffle(order)
    return pack(lengths, order, budget)


def split_indices(ids: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) sample indices. Split by conversation: the per-turn samples `id#k` of one
    conversation share context, so they all land on the same side."""
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        groups.setdefault(sid.split("#", 1)[0], []).append(i)
    order = list(groups)
    random.Random(seed).shuffle(order)
    n_val = math.ceil(len(order) * val_fraction) if val_fraction > 0 else 0
    n_val = min(n_val, len(order) - 1)
    val = sorted(i for g in order[:n_val] for i in groups[g])
    train = sorted(i for g in order[n_val:] for i in groups[g])
    return train, val


def check_fits(data: HiddenStates | StreamedStates, budget: int) -> None:
    """Every sample's supervised tokens must fit one micro-batch: a longer sample is cut to
    `train.batch_tokens`, and the answer tokens past the cut would train nothing, silently."""
    cut = [i for i in range(len(data)) if data.supervised_end(i) > budget]
    if cut:
        longest = max(cut, key=data.num_tokens)
        raise StageError(
            f"{len(cut)} of {len(data)} samples have supervised tokens beyond "
            f"train.batch_tokens={budget} (e.g. {data.ids[longest]}, {data.num_tokens(longest)} "
            f"tokens, answer ends at {data.supervised_end(longest)}): set train.batch_tokens >= "
            f"{max(data.supervised_end(i) for i in cut)}, or lower data.max_seq_len and redo "
            f"stage 01")


# ---------------------------------------------------------------------------------------------
# Model construction


def draft_model_config(cfg: Config, vocab_size: int, draft_vocab_size: int,
                       info: Optional[VerifierInfo] = None) -> DraftModelConfig:
    """The fresh drafter's shape: the `draft` section, else derived from the verifier (`info`,
    default `cfg.verifier_info`)."""
    info, d = info or cfg.verifier_info, cfg.draft
    heads = d.num_attention_heads or info.num_attention_heads
    shape = dict(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size,
        num_aux=len(info.aux_layer_ids),
        intermediate_size=d.intermediate_size or info.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=d.num_key_value_heads or (
            info.num_key_value_heads if not d.num_attention_heads else d.num_attention_heads),
        head_dim=d.head_dim or info.head_dim,
        num_layers=d.num_layers, rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta, max_position_embeddings=info.max_position_embeddings,
        vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
        norm_before_residual=d.norm_before_residual, fc_norm=d.fc_norm,
        norm_output=d.norm_output)
    if d.attention == "mla":
        dims = d.mla_dims(info.mla_dims)
        unknown = [k for k, v in dims.items() if not v and k != "q_lora_rank"]
        if unknown:
            raise ConfigError(f"draft.attention=mla: set draft.{unknown[0]} (the verifier is not "
                              f"MLA, so it gives no default for {', '.join(unknown)})")
        # one latent per token: every head reads the same key/value source
        shape.update(attention="mla", num_key_value_heads=heads, rope_scaling=info.rope_scaling,
                     head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], **dims)
    return DraftModelConfig(**shape)


def build_model(cfg: Config, d2t: torch.Tensor, t2d: torch.Tensor,
                verifier_lm_head: torch.Tensor) -> Eagle3DraftModel:
    """A fresh drafter: verifier embedding (frozen), lm_head from the verifier's draft rows."""
    torch.manual_seed(cfg.train.seed)
    model = Eagle3DraftModel(draft_model_config(cfg, len(t2d), len(d2t)))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(read_tensor(cfg.verifier_path, "embed"))
        model.lm_head.weight.copy_(verifier_lm_head[torch.arange(len(d2t)) + d2t])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    if cfg.train.init_layer == "verifier":
        init_from_verifier_layer(model, cfg.verifier_path, cfg.verifier_info)
    return model


# Llama-shaped decoder layers: RMSNorm weights used as-is, no biases, no q/k norms.
PLAIN_LAYER_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def init_from_verifier_layer(model: Eagle3DraftModel, verifier: Path, info: VerifierInfo,
                             check_only: bool = False) -> None:
    """Start the drafter as the verifier layer that reads the deepest aux state
    (`train.init_layer=verifier`): `fc` passes that state through, and layer 0's hidden half
    of q/k/v, o_proj, MLP and norms are that layer's. The embedding half of q/k/v keeps its
    random init, so the next token enters from the first step. `check_only` compares shapes
    from the file headers and copies nothing (the plan's preflight; a meta-device model)."""
    if info.architecture not in PLAIN_LAYER_ARCHITECTURES:
        raise StageError(f"train.init_layer=verifier needs a Llama-shaped verifier "
                         f"({', '.join(PLAIN_LAYER_ARCHITECTURES)}), not {info.architecture}: "
                         f"set train.init_layer=random")
    if model.cfg.attention != "mha":
        raise StageError("train.init_layer=verifier copies a Llama layer into a Llama (mha) "
                         "draft layer; this drafter's is mla: set train.init_layer=random")
    layer, H, dl = info.aux_layer_ids[-1], model.cfg.hidden_size, model.layers[0]
    if model.cfg.target_hidden_size != H or layer >= info.num_hidden_layers:
        raise StageError(f"train.init_layer=verifier needs the drafter's hidden size to equal "
                         f"the verifier's and a layer after the deepest aux state {layer}: set "
                         f"train.init_layer=random")

    def take(dst: torch.Tensor, name: str) -> None:
        src = lazy_tensor(verifier, f"layers.{layer}.{name}.weight")
        if src.shape != dst.shape:
            raise StageError(f"train.init_layer=verifier: the verifier's layer {layer} {name} is "
                             f"{tuple(src.shape)}, the drafter's {tuple(dst.shape)}: set "
                             f"train.init_layer=random (or draft.* to the verifier's geometry)")
        if not check_only:
            dst.copy_(load_lazy(src))

    with torch.no_grad():
        for proj in ("q_proj", "k_proj", "v_proj"):
            take(getattr(dl.self_attn, proj).weight[:, H:], f"self_attn.{proj}")
        take(dl.self_attn.o_proj.weight, "self_attn.o_proj")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            take(getattr(dl.mlp, proj).weight, f"mlp.{proj}")
        take(dl.hidden_norm.weight, "input_layernorm")
        take(dl.post_attention_layernorm.weight, "post_attention_layernorm")
        if not check_only:
            model.fc.weight.zero_()
            model.fc.weight[:, -H:] = torch.eye(H)


def build_finetune_model(stage: Stage, d2t: torch.Tensor, t2d: torch.Tensor,
                         verifier_lm_head: torch.Tensor, device: torch.device
                         ) -> tuple[Eagle3DraftModel, dict]:
    """The drafter at `train.finetune_from`, keys remapped and every tensor, the vocabulary map
    and the aux ids checked against ours; the base's attention geometry wins (ours is only
    derived). On resume the same model is rebuilt, then the step checkpoint is loaded."""
    cfg = stage.cfg
    embed = read_tensor(cfg.verifier_path, "embed")
    base = base_drafter.load(Path(cfg.train.finetune_from))
    dcfg = base_drafter.finetune_draft_config(draft_model_config(cfg, len(t2d), len(d2t)), base,
                                              intermediate_size=cfg.draft.intermediate_size)
    base_drafter.check_base(base, dcfg, embed, d2t, t2d, allow_remap=cfg.vocab.allow_remap)
    head = (remap_lm_head(load_tensor(base.weights["lm_head.weight"]),
                          base_drafter.vocab_maps(base)[0], d2t, verifier_lm_head)
            if cfg.vocab.allow_remap else None)
    model = Eagle3DraftModel(dcfg)
    model.load_state_dict(base_drafter.base_state_dict(base, embed, d2t, t2d, head))
    ids, convention = _base_aux_ids(stage, base, model, verifier_lm_head, device)
    ours = list(cfg.verifier_info.aux_layer_ids)
    if ids is not None and list(ids) != ours:
        raise StageError(f"base drafter {base.path} was trained on aux ids {base.aux_layer_ids} "
                         f"({base.layout} layout, read {convention}) = {list(ids)} as HF "
                         f"output_hidden_states indices, but the config resolves to {ours}: "
                         f"set verifier.aux_layer_ids={list(ids)} (and redo stage 02)")
    info = {"path": str(base.path), "layout": base.layout, "aux_convention": convention,
            "aux_layer_ids_as_written": base.aux_layer_ids, "aux_layer_ids": ids,
            "vocab_remapped": cfg.vocab.allow_remap}
    log.info("fine-tuning from %s (%s layout, aux ids %s read %s = %s)", base.path, base.layout,
             base.aux_layer_ids, convention, ids)
    return model, info


def _base_aux_ids(stage: Stage, base: base_drafter.BaseDrafter, model: Eagle3DraftModel,
                  lm_head: torch.Tensor, device: torch.device
                  ) -> tuple[Optional[list[int]], str]:
    """(HF indices the base was trained on, how they were read), per
    `train.base_aux_convention`."""
    cfg = stage.cfg
    convention = cfg.train.base_aux_convention
    if base.aux_layer_ids is None:
        return None, "absent"
    if convention == "engine":
        return base.aux_ids_internal(cfg.verifier_info.architecture), "as its engine reads them"
    if convention != "measure":
        return [i + base_drafter.CONVENTIONS[convention] for i in base.aux_layer_ids], convention
    key = _measurement_key(stage, base)
    record = stage.dir / "base_aux_measurement.json"
    saved = json.loads(record.read_text()) if record.exists() else {}
    if saved.get("key") == key:  # a resume: the same base on the same measure set
        scores = saved["scores"]
        log.info("base aux convention: reusing the measurement in %s", record)
    else:
        scores = measure_base(stage, base, model, lm_head, device)
    best = max(scores, key=lambda name: scores[name]["est_accept_len"])
    # Only a clear difference overrules how the base's own engine reads its ids: layers close
    # to each other can score alike (a random or very shallow verifier).
    engine_ids = base.aux_ids_internal(cfg.verifier_info.architecture)
    engine = next((n for n, sc in scores.items() if sc["aux_layer_ids"] == engine_ids), None)
    tie = engine is not None and scores[best]["est_accept_len"] - \
        scores[engine]["est_accept_len"] <= MEASURE_MARGIN
    chosen = engine if tie else best
    if is_rank0() and saved.get("key") != key:
        stage.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record, {"key": key, "base": str(base.path),
                                   "written": base.aux_layer_ids, "chosen": chosen,
                                   "engine_reading": engine, "margin": MEASURE_MARGIN,
                                   "scores": scores})
    log.info("base aux convention scores: %s", ", ".join(
        f"{n} {s['aux_layer_ids']}: est_len {s['est_accept_len']:.3f}" for n, s in scores.items()))
    how = (f"measured: {chosen} (within {MEASURE_MARGIN} of the best, as its engine reads it)"
           if tie and chosen != best else f"measured best: {chosen}")
    return scores[chosen]["aux_layer_ids"], how


MEASURE_MARGIN = 0.01
"""Estimated acceptance length by which a reading must beat the engine's to be chosen."""


def _measurement_key(stage: Stage, base: base_drafter.BaseDrafter) -> dict[str, Any]:
    """What a measurement depends on: the base (its config and files), the measure set (stage
    02's manifest) and how much of it is scored."""
    files = sorted([f.name, f.stat().st_size] for f in Path(base.path).iterdir() if f.is_file())
    config = Path(base.path) / "config.json"
    return {"base": str(Path(base.path).resolve()), "files": files,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()
            if config.exists() else None,
            "measure_set": stage.upstream_hash(2), "ttt_steps": stage.cfg.train.ttt_steps,
            "max_tokens": stage.cfg.train.measure_max_tokens}


@torch.no_grad()
def measure_base(stage: Stage, base: base_drafter.BaseDrafter, model: Eagle3DraftModel,
                 lm_head: torch.Tensor, device: torch.device) -> dict[str, dict[str, Any]]:
    """Score the base (as loaded, before any training) on stage 02's measure set under each
    reading of its written aux ids: the reading it was trained with predicts the verifier.
    Runs on the training device, each rank on its share of the samples (the counts are summed
    over ranks, so every rank gets the same scores), `train.measure_max_tokens` per sample."""
    from eagle3.hidden_states import MEASURE_DIR

    cfg, tc = stage.cfg, stage.cfg.train
    data = HiddenStates(stage.upstream(2).dir / MEASURE_DIR,
                        stage.upstream(2).command("--repair"))
    hidden = data.hidden_size
    model.to(device)
    head = VerifierHead.of(lm_head.to(device), torch.arange(len(model.d2t), device=device)
                           + model.d2t)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    readings = base_drafter.candidate_aux_ids(base.aux_layer_ids,
                                              cfg.verifier_info.num_hidden_layers)
    dist.log0("measuring which layers the base's aux ids %s mean: %d readings x %d samples "
              "(<= %d tokens each) on %s over %d rank(s)", base.aux_layer_ids, len(readings),
              len(data), tc.measure_max_tokens, device, world)
    scores = {}
    for name, ids in readings.items():
        cols = torch.cat([torch.arange(data.aux_layer_ids.index(j) * hidden,
                                       (data.aux_layer_ids.index(j) + 1) * hidden)
                          for j in ids])
        stats = StepStats.zeros(tc.ttt_steps)
        for i in range(rank, len(data), world):
            sample = data[i]
            sample["aux"] = sample["aux"][:, cols]
            budget = max(min(data.num_tokens(i), tc.measure_max_tokens), 1)
            batch, teacher = prepare_batch([sample], budget, device, torch.float32, head)
            # metrics only, which no loss setting changes: the plain spec
            stats.add(ttt_forward(model, batch, teacher, TTTSpec(tc.ttt_steps, tc.step_decay))[1])
        scores[name] = {"aux_layer_ids": ids, **stats.summed().metrics()}
    return scores


# ---------------------------------------------------------------------------------------------
# State


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    """Next micro-batch to read in `epoch` (the data position)."""
    tokens_seen: int = 0
    best_metric: float = -1.0
    best_step: int = -1

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float) -> Any:
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


@dataclass
class Trainer:
    """Everything one training run holds (built by `setup`)."""
    stage: Stage
    ctx: dist.DistContext
    data: HiddenStates | StreamedStates
    lengths: list[int]
    train_idx: list[int]
    val_idx: list[int]
    head: VerifierHead
    model: Eagle3DraftModel
    total_steps: int
    steps_per_epoch: int
    parallel: str
    base_info: dict[str, Any]
    objective: Optional[torch.nn.Module] = None
    """The model's TTT objective as run: plain, DDP or FSDP."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Any = None
    state: TrainState = field(default_factory=TrainState)
    dtype: torch.dtype = torch.float32  # fp32 master weights; bf16 compute under autocast
    bf16: bool = False
    tb: Any = None
    teacher_cache: TeacherCache = field(default_factory=TeacherCache)
    producer: Optional[Producer] = None
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """What the data holds open (a streamed run's verifier or capture server)."""

    @property
    def tc(self) -> Any:
        return self.stage.cfg.train

    @property
    def autocast(self) -> Any:
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def batch(self, group: list[int], loss_on: Optional[str] = None,
              temperature: Optional[float] = None) -> Any:
        samples = self.producer.take(group) if self.producer else None
        return prepare_batch(samples or self.data.get(group), self.tc.batch_tokens,
                             self.ctx.device, self.dtype, self.head, loss_on, temperature,
                             keys=group, cache=self.teacher_cache)


# ---------------------------------------------------------------------------------------------
# Setup and resume


def _load_data(stage: Stage, ctx: dist.DistContext,
               resources: contextlib.ExitStack) -> HiddenStates | StreamedStates:
    """Stage 02's stored states, or (stream mode) the verifier computing them on demand."""
    cfg = stage.cfg
    if is_streamed(stage):
        data = open_streamed(stage, ctx, resources)
    else:
        data = HiddenStates(stage.upstream(2).dir, stage.upstream(2).command("--repair"))
    if not data.final_is_post_norm:
        raise StageError("02_hidden_states stored pre-norm final states; this trainer expects "
                         "post-norm (rerun 02_extract_hidden_states.py --restart)")
    if list(data.aux_layer_ids) != list(cfg.verifier_info.aux_layer_ids):
        raise StageError(f"02_hidden_states has aux ids {list(data.aux_layer_ids)} but the "
                         f"config resolves to {list(cfg.verifier_info.aux_layer_ids)}")
    check_fits(data, cfg.train.batch_tokens)
    return data


def setup(stage: Stage) -> Trainer:
    """Data, split, schedule, model (fresh or fine-tuned), parallel wrap and optimizer."""
    tc = stage.cfg.train
    stage.require(2)
    stage.require(3)
    if tc.tensorboard:
        _tensorboard_writer_class()  # fail on every rank before any work, not later on rank 0
    ctx = dist.init(tc.device, tc.collective_timeout_min)
    resources = contextlib.ExitStack()
    try:
        return _setup(stage, ctx, resources)
    except BaseException:
        resources.close()  # a streamed run's verifier or capture server goes with the error
        raise


def _setup(stage: Stage, ctx: dist.DistContext, resources: contextlib.ExitStack) -> Trainer:
    cfg, tc = stage.cfg, stage.cfg.train
    data = _load_data(stage, ctx, resources)
    d2t, t2d = load_vocab(stage.upstream(3).dir, stage.upstream(3).command("--repair"))
    lm_head = read_tensor(cfg.verifier_path, "lm_head").to(ctx.device, torch.float32)
    lengths = [data.num_tokens(i) for i in range(len(data))]
    train_idx, val_idx = split_indices(data.ids, tc.val_fraction, tc.seed)
    # One optimizer step consumes grad_accum micro-batches on every rank.
    per_epoch = len(epoch_batches(lengths, train_idx, tc.batch_tokens, tc.seed, 0))
    steps_per_epoch = math.ceil(per_epoch / (tc.grad_accum * ctx.world_size))
    total = steps_per_epoch * tc.epochs
    total = min(total, tc.max_steps) if tc.max_steps is not None else total
    base_info: dict[str, Any] = {}
    if tc.finetune_from:
        model, base_info = build_finetune_model(stage, d2t, t2d, lm_head.cpu(), ctx.device)
    else:
        model = build_model(cfg, d2t, t2d, lm_head.cpu())
    model = model.to(ctx.device)
    model.lm_head.weight.requires_grad_(not tc.freeze_lm_head)
    parallel = tc.parallel if ctx.world_size > 1 else "none"
    t = Trainer(stage, ctx, data, lengths, train_idx, val_idx,
                VerifierHead.of(lm_head, torch.arange(len(d2t)) + d2t), model, total,
                steps_per_epoch, parallel, base_info, bf16=tc.autocast == "bf16" or (
                    tc.autocast == "auto" and ctx.device.type == "cuda"),
                resources=resources)
    # Resume weights go in before any wrapping: every rank reads the same full checkpoint.
    saved = _load_latest(t)
    t.objective = dist.wrap(TTTObjective(model, TTTSpec.of(tc)), parallel, ctx)
    t.params = [p for p in model.parameters() if p.requires_grad]  # after FSDP's re-wrap
    t.optimizer = torch.optim.AdamW(t.params, lr=tc.lr, weight_decay=tc.weight_decay,
                                    betas=tuple(tc.adam_betas))
    t.scheduler = torch.optim.lr_scheduler.LambdaLR(
        t.optimizer, lr_lambda(total, tc.warmup_ratio, tc.min_lr_ratio))
    if saved is not None:
        _restore(t, saved)
    if isinstance(data, StreamedStates) and cfg.hidden_states.cache_gb > 0:
        if ctx.is_main:  # before any rank writes to it
            clean_stale_tmp(stage.dir / STATE_CACHE)
        dist.barrier()
        order = [i for g in epoch_batches(lengths, train_idx, tc.batch_tokens, tc.seed, 0)
                 for i in g]
        data.cache = StateCache.plan(stage.dir / STATE_CACHE, order, lengths,
                                     data.index["bytes_per_token"], cfg.hidden_states.cache_gb)
        dist.log0("state cache: %d of %d training samples (up to %.3f GB) kept in %s after "
                  "their first computation; the rest are streamed every epoch",
                  len(data.cache.keep), len(train_idx), cfg.hidden_states.cache_gb,
                  stage.dir / STATE_CACHE)
    return t


def _load_latest(t: Trainer) -> Optional[ckpt.Checkpoint]:
    """The newest intact checkpoint (weights loaded into the model), or None to start fresh."""
    stage, ctx = t.stage, t.ctx
    if ctx.is_main:
        stage.dir.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(stage.dir)
        ckpt.check_kept(stage.dir, stage.cfg.run.verify, _val_scores(stage.dir / "metrics.jsonl"))
    dist.barrier()
    steps = ckpt.step_dirs(stage.dir)
    if not steps:
        return None
    saved = ckpt.load(steps[-1][1], with_trainer_state=True)
    ours = list(stage.cfg.verifier_info.aux_layer_ids)
    if saved.draft != t.model.cfg or saved.aux_layer_ids != ours:
        diff = [k for k, v in t.model.cfg.to_dict().items() if saved.draft.to_dict()[k] != v]
        raise StageError(f"{saved.path} was trained with another draft shape or aux ids "
                         f"({diff or saved.aux_layer_ids}); rerun 04_train.py --restart to start "
                         f"over")
    _check_recipe(stage, saved)
    world = saved.trainer_state["world_size"]
    if world != ctx.world_size:
        raise StageError(f"{saved.path} was written by {world} processes, this run has "
                         f"{ctx.world_size}: resume with the same world size")
    t.model.load_state_dict({**saved.weights, "embed_tokens.weight": t.model.embed_tokens.weight})
    return saved


def _check_recipe(stage: Stage, saved: ckpt.Checkpoint) -> None:
    """A resumed run must continue the recipe it started with: a changed lr or loss would be
    half applied (the restored scheduler keeps the old schedule) and then claimed for the whole
    run by the manifest and the model card."""
    if saved.recipe is None:
        return  # a checkpoint from before recipes were recorded
    changes = config_changes(saved.recipe, depends_on(stage.cfg, 4, own_only=True))
    if changes:
        more = and_more(changes)
        raise StageError(f"{saved.path.name} was trained with other settings ({changes[0]}"
                         f"{more}): rerun `{stage.command('--restart')}` to train with the new "
                         f"ones (the old run is moved aside), or revert the setting to resume")


def _restore(t: Trainer, saved: ckpt.Checkpoint) -> None:
    state = saved.trainer_state
    dist.load_optimizer_state(t.optimizer, state["optimizer"], t.params)
    t.scheduler.load_state_dict(state["scheduler"])
    t.state = TrainState(**state["train_state"])
    best = ckpt.read_pointer(t.stage.dir, "best")
    if best is not None and best.name != f"step-{t.state.best_step}":
        # `best` was moved off a damaged checkpoint: later checkpoints compete with it
        step = int(ckpt.STEP_RE.match(best.name).group(1))
        t.state.best_step = step
        t.state.best_metric = _val_scores(t.stage.dir / "metrics.jsonl").get(step, -1.0)
    ckpt.set_rng_state(state["rng"][t.ctx.rank])
    log.info("resumed from %s (step %d, epoch %d, batch %d)", saved.path.name, t.state.step,
             t.state.epoch, t.state.batch_in_epoch)


def preflight(stage: Stage) -> None:
    """What stage 04 can check before anything is moved or written (`--restart` included)."""
    cfg = stage.cfg
    if cfg.train.tensorboard:
        _tensorboard_writer_class()
    if cfg.train.finetune_from and not Path(cfg.train.finetune_from).expanduser().is_dir():
        raise StageError(f"train.finetune_from: {cfg.train.finetune_from} is not a directory "
                         f"(give the base drafter's checkpoint folder)")
    read_tensor(cfg.verifier_path, "embed")


def smoke(stage: Stage) -> None:
    """`04_train.py --smoke`: the run's setup, then two optimizer steps on one micro-batch per
    rank packed from the longest training samples (the heaviest micro-batch the run will see):
    peak memory next to the plan's prediction, and tokens/s of the second step. No checkpoint,
    metric or manifest is written; the weights are dropped."""
    t = setup(stage)
    with t.resources:
        _smoke(t)
    dist.destroy()


def _smoke(t: Trainer) -> None:
    import resource

    from eagle3.plan import GB, training_memory

    stage, tc, ctx = t.stage, t.tc, t.ctx
    group, tokens = [], 0
    for i in sorted(t.train_idx, key=lambda i: -t.lengths[i]):
        n = min(t.lengths[i], tc.batch_tokens)
        if tokens + n <= tc.batch_tokens:
            group.append(i)
            tokens += n
    longest = min(t.lengths[group[0]], tc.batch_tokens)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    rates = []
    for _ in range(2):  # the first step allocates AdamW's moments and warms the kernels up
        if cuda:
            torch.cuda.synchronize(ctx.device)
        started = time.time()
        train_step(t, [group] * ctx.world_size)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        rates.append(tokens / max(time.time() - started, 1e-9))
    if cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device)
        where = (f"{peak / GB:.1f} GB allocated at most on {ctx.device} "
                 f"({torch.cuda.max_memory_reserved(ctx.device) / GB:.1f} GB reserved)")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        where = f"{peak / GB:.2f} GB peak resident size of the process (CPU)"
    peaks = dist.all_reduce_sum([peak if r == ctx.rank else 0.0 for r in range(ctx.world_size)])
    mem = training_memory(stage.cfg, stage.cfg.verifier_info, tokens)
    predicted = (f"; the plan predicts {mem['peak'][t.parallel] / GB:.1f} GB for this "
                 f"micro-batch on a GPU (bf16 fit of {mem['fit_source']})"
                 if "peak" in mem else "")
    log.info("smoke: %d samples, %d tokens (longest %d), TTT %d: %s%s; %.0f tokens/s per "
             "process in the second step; peak over ranks %.2f GB; nothing written",
             len(group), tokens, longest, tc.ttt_steps, where, predicted, rates[-1],
             max(peaks) / GB)


# ---------------------------------------------------------------------------------------------
# One step, validation, checkpoints


def train_step(t: Trainer, step_groups: list[list[int]]) -> tuple[StepStats, torch.Tensor]:
    """One optimizer step over `step_groups` (this step's micro-batches on all ranks); returns
    the global counts and the gradient norm. Non-finite loss or gradients stop the run."""
    ctx, tc = t.ctx, t.tc
    # Each micro-batch's loss is weighted so that the (rank-averaged) gradient is the mean over
    # all micro-batches of the step. Every rank runs the same number of micro-batches (their
    # collectives must pair up): one short of data repeats one with weight 0.
    mine = step_groups[ctx.rank::ctx.world_size]
    n_micro = math.ceil(len(step_groups) / ctx.world_size)
    work = [(g, ctx.world_size / len(step_groups)) for g in mine] + \
        [(step_groups[0], 0.0)] * (n_micro - len(mine))
    t.optimizer.zero_grad(set_to_none=True)
    stats = StepStats.zeros(tc.ttt_steps)
    finite = True
    for n, (group, weight) in enumerate(work):
        batch, teacher = t.batch(group, tc.loss_on)
        with dist.grad_sync(t.objective, n == len(work) - 1), t.autocast:
            loss, s = t.objective(batch, teacher)
            (loss * weight).backward()
        finite &= bool(torch.isfinite(loss))
        if weight > 0:
            stats.add(s)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        t.params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    bad = dist.all_reduce_sum([float(not finite)])[0] > 0
    if bad or not math.isfinite(dist.to_float(grad_norm)):
        raise _nonfinite_error(t, step_groups, "loss" if bad else "gradient norm")
    t.optimizer.step()
    t.scheduler.step()
    return stats.summed(), grad_norm


def _nonfinite_error(t: Trainer, step_groups: list[list[int]], what: str) -> StageError:
    """Name the step, its samples (those with non-finite stored states first) and the last good
    checkpoint. Nothing of this step is applied or saved."""
    samples = [i for g in step_groups for i in g]
    broken = [i for i in samples if not all(bool(torch.isfinite(v.float()).all())
                                            for v in t.data[i].values())]
    named = broken or samples
    where = ", ".join(f"{t.data.ids[i]} ({t.data.shard_of(i)})" for i in named[:5])
    good = ckpt.step_dirs(t.stage.dir)
    return StageError(
        f"non-finite {what} at step {t.state.step + 1}: "
        f"{'samples with non-finite hidden states: ' if broken else 'samples of this step: '}"
        f"{where}{' ...' if len(named) > 5 else ''}; last good checkpoint: "
        f"{good[-1][1] if good else 'none'}. "
        + (f"Redo those shards: `{t.stage.upstream(2).command('--repair')}`" if broken
           else "Lower train.lr or check the data, then rerun (training resumes from the "
                "checkpoint)"))


def validate(t: Trainer) -> dict[str, Any]:
    """Metrics over the validation split (assistant tokens only), on every rank."""
    ctx, tc = t.ctx, t.tc
    t.objective.eval()
    temp = tc.estimate_temperature
    stats = StepStats.zeros(tc.ttt_steps, temp)
    groups = pack(t.lengths, t.val_idx, tc.batch_tokens)
    # Sharded weights are gathered inside the (FSDP) objective's forward, so under FSDP every
    # rank must run as many forwards: a rank short of batches repeats one, uncounted.
    forward = t.objective if t.parallel == "fsdp" else (
        lambda b, teacher, temp: ttt_forward(t.model, b, teacher, TTTSpec.of(tc), temp))
    with torch.no_grad():
        for r in range(math.ceil(len(groups) / ctx.world_size)):
            i = r * ctx.world_size + ctx.rank
            batch, teacher = t.batch(groups[i] if i < len(groups) else groups[0],
                                     temperature=temp)
            with t.autocast:
                s = forward(batch, teacher, temp)[1]
            if i < len(groups):
                stats.add(s)
    t.objective.train()
    stats = stats.summed()
    if not math.isfinite(stats.objective):
        raise _nonfinite_error(t, [t.val_idx], "validation loss")
    return stats.metrics()


def save(t: Trainer, val: dict[str, Any]) -> None:
    """A checkpoint of the current step (a collective under FSDP); `best` follows `val`."""
    cfg, ctx, state = t.stage.cfg, t.ctx, t.state
    if val["est_accept_len"] > state.best_metric:
        state.best_metric, state.best_step = val["est_accept_len"], state.step
    rng = dist.gather_objects(ckpt.rng_state())  # every rank's generators, in rank order
    # Under FSDP gathering the full tensors is a collective: every rank takes part.
    weights = dist.full_tensors(t.model.trainable_state_dict())
    optimizer_state = dist.full_optimizer_state(t.optimizer)
    if ctx.is_main:
        trainer_state = {"optimizer": optimizer_state, "scheduler": t.scheduler.state_dict(),
                         "train_state": state.state_dict(), "rng": rng,
                         "world_size": ctx.world_size}
        aux = list(cfg.verifier_info.aux_layer_ids)
        spec = speculators_config(t.model.cfg, aux, ExportContext(
            str(cfg.verifier_path.resolve()), cfg.verifier_info.architecture,
            cfg.export.speculative_tokens))
        path = ckpt.save(t.stage.dir, state.step, weights, t.model.cfg, aux, spec,
                         trainer_state, depends_on(cfg, 4, own_only=True))
        if state.best_step == state.step:
            ckpt.set_best(t.stage.dir, path)
        ckpt.prune(t.stage.dir, t.tc.keep)
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# The loop


def run_train(stage: Stage) -> None:
    """Stage 04 entry point: setup, resume, steps with periodic validation and checkpoints,
    finish."""
    started = time.time()
    t = setup(stage)
    with t.resources:
        _train_loop(t)
    finish(t, started)


def _train_loop(t: Trainer) -> None:
    stage, tc, ctx = t.stage, t.tc, t.ctx
    if ctx.is_main:
        _truncate_metrics(stage.dir / "metrics.jsonl", t.state.step)
    _log_start(t)
    t.tb = _tensorboard(stage.dir, t.state.step) if tc.tensorboard and ctx.is_main else None
    log_window = _LogWindow(t)
    streamed = isinstance(t.data, StreamedStates)
    # Stored: this step's and the next step's micro-batches are read from the disk (own file
    # handles) while this one computes. Streamed: the verifier runs `stream_ahead` ahead.
    per_step = tc.grad_accum * ctx.world_size
    depth = stage.cfg.hidden_states.stream_ahead if streamed else 2 * tc.grad_accum
    t.producer = Producer(t.data.get if streamed else HiddenStates(stage.upstream(2).dir).get,
                          depth)
    flow = _DataFlow(t, "stream" if streamed else "store", depth)
    batches, batches_epoch = [], -1
    while t.state.step < t.total_steps:
        state = t.state
        if batches_epoch != state.epoch:
            batches = epoch_batches(t.lengths, t.train_idx, tc.batch_tokens, tc.seed, state.epoch)
            batches_epoch = state.epoch
        at = state.batch_in_epoch
        groups = batches[at:at + per_step]
        # this rank's micro-batches from this step on, in the order it trains on them
        t.producer.ahead(batches[at:at + depth * ctx.world_size][ctx.rank::ctx.world_size])
        step_started = time.perf_counter()
        stats, grad_norm = train_step(t, groups)
        flow.step(time.perf_counter() - step_started, groups[ctx.rank::ctx.world_size])
        state.step += 1
        state.tokens_seen += sum(min(t.lengths[i], tc.batch_tokens) for g in groups for i in g)
        state.batch_in_epoch += len(groups)
        if state.batch_in_epoch >= len(batches):
            flow.record(state.epoch)
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            t.teacher_cache.share()
        record = {"step": state.step, "epoch": state.epoch, "lr": t.scheduler.get_last_lr()[0],
                  "grad_norm": round(dist.to_float(grad_norm), 4), "tokens": state.tokens_seen,
                  **stats.metrics()}
        val = None
        if state.step % tc.checkpoint_every == 0 or state.step == t.total_steps:
            val = record["val"] = validate(t) if t.val_idx else stats.metrics()
        _record(t, record)
        log_window.add(stats, record, val)
        if val is not None:
            save(t, val)
    flow.record(t.state.epoch, partial=True)
    t.producer.close()


DATA_FLOW = "data_flow.jsonl"


class _DataFlow:
    """Per epoch, where the time went (rank 0's view, appended to `04_train/data_flow.jsonl`):
    the producer's capacity (tokens/s it delivers while working), the trainer's (tokens/s it
    trains while not waiting) and the fraction of step time the trainer waited on data. Kept
    apart from metrics.jsonl, which must be identical between a run and its resumed copy."""

    def __init__(self, t: Trainer, mode: str, depth: int) -> None:
        self.t, self.mode, self.depth = t, mode, depth
        self.step_s, self.tokens, self.steps = 0.0, 0, 0
        self.captured = self._captured()

    def _captured(self) -> tuple[int, int]:
        data = self.t.data
        return (data.captured_tokens, data.cached_tokens) \
            if isinstance(data, StreamedStates) else (0, 0)

    def step(self, seconds: float, mine: list[list[int]]) -> None:
        self.step_s += seconds
        self.tokens += sum(self.t.lengths[i] for g in mine for i in g)
        self.steps += 1

    def record(self, epoch: int, partial: bool = False) -> None:
        t = self.t
        w = t.producer.window()
        if self.steps == 0:
            return
        busy_trainer = max(self.step_s - w["waited_s"], 1e-9)
        rec = {"epoch": epoch, "step": t.state.step, "partial": partial, "mode": self.mode,
               "steps": self.steps, "step_s": round(self.step_s, 3),
               "waited_s": round(w["waited_s"], 3),
               "wait_fraction": round(w["waited_s"] / max(self.step_s, 1e-9), 4),
               "producer_tokens_per_s": round(w["producer_tokens"] / max(
                   w["producer_busy_s"], 1e-9), 1),
               "trainer_tokens_per_s": round(self.tokens / busy_trainer, 1),
               "buffer_bound": self.depth, "buffer_max": t.producer.max_pending}
        if self.mode == "stream":  # what the verifier computed (validation included)
            now = self._captured()
            rec["verifier_tokens"], rec["cache_read_tokens"] = (
                now[0] - self.captured[0], now[1] - self.captured[1])
            self.captured = now
            cache = t.data.cache
            rec["cache_bytes"] = cache.bytes() if cache else 0
        bottleneck = ("the producer (verifier)" if self.mode == "stream" else "the disk") \
            if rec["wait_fraction"] > 0.05 else "the trainer"
        log.info("epoch %d%s data flow (%s): producer %.0f tok/s, trainer %.0f tok/s, the "
                 "trainer waited %.1f%% of %.1f s: %s is the bottleneck", epoch,
                 " (partial)" if partial else "", self.mode, rec["producer_tokens_per_s"],
                 rec["trainer_tokens_per_s"], 100 * rec["wait_fraction"], self.step_s,
                 bottleneck)
        if t.ctx.is_main:
            with open(t.stage.dir / DATA_FLOW, "a") as f:
                f.write(json.dumps(rec) + "\n")
        self.step_s, self.tokens, self.steps = 0.0, 0, 0


def _log_start(t: Trainer) -> None:
    n_params = sum(p.numel() for p in t.params)
    log.info("drafter: %d trainable parameters; %d train / %d val samples; %d steps "
             "(%d per epoch, %d micro-batches each over %d process(es)%s); ttt_steps %d",
             n_params, len(t.train_idx), len(t.val_idx), t.total_steps, t.steps_per_epoch,
             t.tc.grad_accum * t.ctx.world_size, t.ctx.world_size,
             f", {t.parallel}" if t.ctx.world_size > 1 else "", t.tc.ttt_steps)


class _LogWindow:
    """One line every `train.log_every` steps, over the steps since the last line."""

    def __init__(self, t: Trainer) -> None:
        self.t = t
        self.window = StepStats.zeros(t.tc.ttt_steps)
        self.t_last, self.tok_last = time.time(), t.state.tokens_seen

    def add(self, stats: StepStats, record: dict[str, Any], val: Optional[dict]) -> None:
        t = self.t
        self.window.add(stats)
        if t.state.step % t.tc.log_every and val is None:
            return
        wm = self.window.metrics()
        rate = (t.state.tokens_seen - self.tok_last) / max(time.time() - self.t_last, 1e-9)
        log.info("step %d/%d | loss %.4f | acc0 %.3f | est_len %.3f | lr %.2e | %.0f tok/s%s",
                 t.state.step, t.total_steps, record["loss"], wm["acc"][0],
                 wm["est_accept_len"], record["lr"], rate,
                 (f" | val est_len {val['est_accept_len']:.3f}" + (
                     f" (T={val['sampled_temperature']:g}: sampled drafts "
                     f"{val['est_accept_len_sampled']:.3f}, greedy drafts "
                     f"{val['est_accept_len_greedy_draft']:.3f})"
                     if "est_accept_len_sampled" in val else "")) if val else "")
        self.window = StepStats.zeros(t.tc.ttt_steps)
        self.t_last, self.tok_last = time.time(), t.state.tokens_seen


def _record(t: Trainer, record: dict[str, Any]) -> None:
    if not t.ctx.is_main:
        return
    with open(t.stage.dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if t.tb is not None:
        _tensorboard_record(t.tb, record)
        if "val" in record:
            t.tb.flush()


def finish(t: Trainer, started: float) -> None:
    """Plot, manifest (rank 0), process group down."""
    from eagle3.runs import file_records

    if t.tb is not None:
        t.tb.close()
    dist.destroy()
    if not t.ctx.is_main:
        return
    stage, state = t.stage, t.state
    latest = ckpt.step_dirs(stage.dir)[-1][1]
    best = ckpt.read_pointer(stage.dir, "best") or latest
    for path in {latest, best}:  # nothing enters the manifest that fails its own record
        problems = ckpt.damage(path, stage.cfg.run.verify)
        if problems:
            raise StageError(f"checkpoint {path.name} is damaged ({problems[0]}): rerun "
                             f"`{stage.command('--repair')}`")
    metrics = stage.dir / "metrics.jsonl"
    final_val = json.loads(metrics.read_text().splitlines()[-1]).get("val")
    flow_path = stage.dir / DATA_FLOW
    flow = [json.loads(line) for line in flow_path.read_text().splitlines()] \
        if flow_path.is_file() else []
    _plot_metrics(stage.dir)
    stage.write_manifest(
        inputs={"02_hidden_states": stage.upstream_hash(2), "03_vocab": stage.upstream_hash(3)},
        outputs={"latest": latest.name, "best": best.name, "metrics": "metrics.jsonl"},
        counts={"steps": state.step, "tokens_seen": state.tokens_seen,
                "train_samples": len(t.train_idx), "val_samples": len(t.val_idx),
                "trainable_parameters": sum(p.numel() for p in t.params),
                "best_step": int(best.name.split("-")[1]), "parallel": t.parallel,
                "best_val_est_accept_len": state.best_metric, "world_size": t.ctx.world_size,
                "aux_layer_ids": list(stage.cfg.verifier_info.aux_layer_ids)},
        files=file_records(stage.dir, sorted({latest, best, stage.dir / "best",
                                              stage.dir / "latest"})),
        started=started, final_val=final_val, finetune_from=t.base_info or None,
        hidden_states_mode="stream" if isinstance(t.data, StreamedStates) else "store",
        data_flow=flow)


# ---------------------------------------------------------------------------------------------
# Metrics files


def _val_scores(path: Path) -> dict[int, float]:
    """step -> validation est_accept_len of every checkpoint step metrics.jsonl records."""
    scores: dict[int, float] = {}
    if not path.is_file():
        return scores
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            scores[int(record["step"])] = float(record["val"]["est_accept_len"])
        except (ValueError, KeyError, TypeError):
            continue  # a line without validation, or cut by a kill
    return scores


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (they will be logged again)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in keep))


def _tensorboard_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise StageError("train.tensorboard=true needs TensorBoard: pip install tensorboard "
                         "(or set train.tensorboard=false)") from None
    return SummaryWriter


def _tensorboard(train_dir: Path, step: int) -> Any:
    """A SummaryWriter under 04_train/tensorboard/; on resume, events after `step` (logged
    again by this run) are purged, as metrics.jsonl is truncated."""
    return _tensorboard_writer_class()(str(train_dir / "tensorboard"),
                                       purge_step=step + 1 if step else None)


def _tensorboard_record(tb: Any, record: dict[str, Any]) -> None:
    step = record["step"]
    for split, metrics in (("train", record), ("val", record.get("val") or {})):
        for key, value in metrics.items():
            if isinstance(value, list):
                for k, x in enumerate(value):
                    tb.add_scalar(f"{split}/{key}_{k}", x, step)
            elif key in ("loss", "lr", "grad_norm", "est_accept_len", "est_accept_len_sampled",
                         "est_accept_len_greedy_draft", "tokens"):
                tb.add_scalar(f"{split}/{key}", value, step)


def _plot_metrics(train_dir: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    if not recs:
        return
    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, [r["loss"] for r in recs])
    a.set_xlabel("step"), a.set_ylabel("loss"), a.set_title("TTT loss")
    for k in range(len(recs[0]["acc"])):
        b.plot(steps, [r["acc"][k] for r in recs], label=f"acc_{k}")
    b.set_xlabel("step"), b.set_title("per-step accuracy"), b.legend()
    fig.tight_layout()
    fig.savefig(train_dir / "metrics.png")
    plt.close(fig)
