"""Stage 04: training-time-test (TTT) training of the EAGLE-3 drafter, with exact resume.

    python 04_train.py configs/smollm2-135m-cpu.yaml [train.lr=3e-4] [--finetune-from DIR]

Alignment (REFERENCE.md section 4). For a document x_0..x_{L-1} with aux states g_t and the
verifier's final states f_t, TTT step k at position t:
    input token  x_{t+1+k}, hidden = the draft's own pre-norm output of step k-1 (fc(g_t) at 0)
    target       x_{t+2+k}; teacher = softmax over the draft vocabulary of lm_head(f_{t+1+k})
    RoPE         position t + k; attends to step-0 keys <= t (same document) and to its own
                 earlier steps' keys at t
    counted      when x_{t+2+k} is inside the document and loss_mask[t+2+k] = 1 (in training
                 with `train.loss_on=all`, every position: prompts too; never in validation)
The loss of step k is the soft cross-entropy against the teacher over positions counted whose
teacher argmax lies in the draft vocabulary, divided by the positions counted; steps are
weighted step_decay**k and summed. Metrics: acc_k (draft argmax == verifier argmax), full_acc_k
(steps 0..k all right, over chains started at step-0-counted positions), and the estimated
acceptance length 1 + sum_k full_acc_k.

Data order is a pure function of (seed, epoch), so the resume point is just (epoch, batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from eagle3 import checkpoint as ckpt
from eagle3 import dist
from eagle3.config import Config
from eagle3.formats import speculators_config
from eagle3.hidden_states import HiddenStates, pack
from eagle3.model import DraftModelConfig, Eagle3DraftModel, causal_doc_mask
from eagle3.runs import Stage, StageError, atomic_write_text, clean_stale_tmp
from eagle3.vocab import load_vocab

log = logging.getLogger("eagle3")


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """One packed row of documents, tensors shaped [1, T, ...]."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor
    doc_end: torch.Tensor
    """Exclusive end index (in the packed row) of each position's document."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device, dtype: torch.dtype) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(
            device, dtype=dtype if getattr(self, f.name).is_floating_point() else None)
            for f in dataclasses.fields(self)})


def collate(samples: list[dict[str, torch.Tensor]], max_tokens: int) -> Batch:
    ids, masks, aux, final, doc_ids, pos, end = [], [], [], [], [], [], []
    start = 0
    for d, s in enumerate(samples):
        T = min(len(s["input_ids"]), max_tokens)
        ids.append(s["input_ids"][:T].long())
        masks.append(s["loss_mask"][:T].bool())
        aux.append(s["aux"][:T])
        final.append(s["final"][:T])
        doc_ids.append(torch.full((T,), d, dtype=torch.long))
        pos.append(torch.arange(T, dtype=torch.long))
        end.append(torch.full((T,), start + T, dtype=torch.long))
        start += T
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    return Batch(cat(ids), cat(masks), cat(aux), cat(final), cat(doc_ids), cat(pos), cat(end))


def training_targets(batch: Batch, loss_on: str) -> Batch:
    """The batch whose `loss_mask` training uses: unchanged for `assistant`; every position for
    `all`. Prompt positions still have the verifier's distribution as their teacher, so they add
    signal without any extra generation or extraction; validation never calls this."""
    if loss_on == "all":
        return dataclasses.replace(batch, loss_mask=torch.ones_like(batch.loss_mask))
    return batch


def epoch_batches(lengths: list[int], indices: list[int], budget: int, seed: int,
                  epoch: int) -> list[list[int]]:
    order = list(indices)
    random.Random(seed * 1000003 + epoch).shuffle(order)
    return pack(lengths, order, budget)


def split_indices(ids: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(len(ids)))
    random.Random(seed).shuffle(order)
    n_val = math.ceil(len(ids) * val_fraction) if val_fraction > 0 else 0
    n_val = min(n_val, len(ids) - 1)
    return sorted(order[n_val:]), sorted(order[:n_val])


# ---------------------------------------------------------------------------------------------
# Teacher and TTT loss


@dataclass
class Teacher:
    """The verifier's next-token view of each position: draft-vocab logits and full argmax."""
    draft_logits: torch.Tensor  # [1, T, Vd]
    argmax: torch.Tensor        # [1, T] target ids


@torch.no_grad()
def make_teacher(final: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor,
                 needed: Optional[torch.Tensor] = None, chunk: int = 1024) -> Teacher:
    """Teacher from post-norm final states; full-vocab logits are built `chunk` rows at a time.

    Only rows in `needed` ([1, T] bool, default all) are computed; the others are zero and must
    never be read. The full-vocab product is the costliest part of a small drafter's step, and
    prompt positions (no loss) need none."""
    flat = final.reshape(-1, final.shape[-1])
    rows = torch.arange(flat.shape[0], device=flat.device) if needed is None else \
        needed.reshape(-1).nonzero().squeeze(1)
    draft = flat.new_zeros(flat.shape[0], len(draft_ids), dtype=torch.float32)
    argmax = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, len(rows), chunk):
        r = rows[i:i + chunk]
        full = flat[r].float() @ lm_head.float().T
        argmax[r] = full.argmax(-1)
        draft[r] = full[:, draft_ids]
    shape = final.shape[:-1]
    return Teacher(draft.view(*shape, -1), argmax.view(shape))


def teacher_rows(batch: Batch) -> torch.Tensor:
    """Positions whose teacher some TTT step reads: the teacher at p is used only when the token
    at p + 1 is in p's document and supervised (see `ttt_forward`: src = p, tgt = p + 1)."""
    T = batch.num_tokens
    nxt = torch.arange(1, T + 1, device=batch.input_ids.device)[None]
    supervised = torch.cat([batch.loss_mask[:, 1:], torch.zeros_like(batch.loss_mask[:, :1])],
                           dim=1)
    return (nxt < batch.doc_end) & supervised


@dataclass
class StepStats:
    """Summed counts over positions, so metrics aggregate exactly across batches and ranks."""
    loss: list[float]
    counted: list[int]
    correct: list[int]
    full: list[int]

    @classmethod
    def zeros(cls, k: int) -> "StepStats":
        return cls([0.0] * k, [0] * k, [0] * k, [0] * k)

    def add(self, other: "StepStats") -> None:
        for name in ("loss", "counted", "correct", "full"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for i in range(len(mine)):
                mine[i] += theirs[i]

    def metrics(self) -> dict[str, Any]:
        chains = max(self.counted[0], 1)
        full_acc = [f / chains for f in self.full]
        out = {
            "acc": [c / max(n, 1) for c, n in zip(self.correct, self.counted)],
            "full_acc": full_acc,
            "cond_acc": [self.full[0] / chains] + [
                self.full[k] / max(self.full[k - 1], 1) for k in range(1, len(self.full))],
            "est_accept_len": 1.0 + sum(full_acc),
        }
        return {k: ([round(x, 5) for x in v] if isinstance(v, list) else round(v, 5))
                for k, v in out.items()}


def ttt_forward(model: Eagle3DraftModel, batch: Batch, teacher: Teacher, ttt_steps: int,
                step_decay: float) -> tuple[torch.Tensor, StepStats]:
    """Unroll `ttt_steps` draft steps on a packed batch; return (weighted loss, counts)."""
    T = batch.num_tokens
    idx = torch.arange(T, device=batch.input_ids.device)[None]
    mask = causal_doc_mask(batch.doc_ids)
    cache = model.new_cache()
    h = model.project(batch.aux)
    alive = None
    total = h.new_zeros(())
    stats = StepStats.zeros(ttt_steps)
    for k in range(ttt_steps):
        src = idx + 1 + k                      # position of the input token (and its teacher)
        tgt = src + 1                          # position of the predicted token
        in_doc = src < batch.doc_end
        src_c, tgt_c = src.clamp(max=T - 1), tgt.clamp(max=T - 1)
        input_ids = torch.where(in_doc, batch.input_ids.gather(1, src_c), 0)
        counted = (tgt < batch.doc_end) & batch.loss_mask.gather(1, tgt_c)
        h, logits = model.step(h, input_ids, batch.positions + k, mask, cache)

        t_logits = teacher.draft_logits.gather(
            1, src_c[..., None].expand(-1, -1, teacher.draft_logits.shape[-1]))
        t_argmax = teacher.argmax.gather(1, src_c)
        in_vocab = model.t2d[t_argmax]
        weight = (counted & in_vocab).float()
        p = torch.softmax(t_logits.float(), dim=-1)
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        n = counted.sum()
        loss_k = (ce * weight).sum() / n.clamp(min=1)
        total = total + (step_decay ** k) * loss_k

        with torch.no_grad():
            correct = counted & (model.draft_to_target(logits.argmax(-1)) == t_argmax)
            if alive is None:
                alive, chains = correct, counted
            else:
                alive = alive & correct
            stats.loss[k] = float(loss_k)
            stats.counted[k] = int(n)
            stats.correct[k] = int(correct.sum())
            stats.full[k] = int((alive & chains).sum())
    return total, stats


# ---------------------------------------------------------------------------------------------
# Model construction


def draft_model_config(cfg: Config, vocab_size: int, draft_vocab_size: int) -> DraftModelConfig:
    info = cfg.verifier_info
    return DraftModelConfig(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size,
        num_aux=len(info.aux_layer_ids),
        intermediate_size=cfg.draft.intermediate_size or info.intermediate_size,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
        num_layers=cfg.draft.num_layers, rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta, max_position_embeddings=info.max_position_embeddings,
        vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
        norm_before_residual=cfg.draft.norm_before_residual)


def build_model(cfg: Config, d2t: torch.Tensor, t2d: torch.Tensor,
                verifier_lm_head: torch.Tensor) -> Eagle3DraftModel:
    """A fresh drafter: verifier embedding (frozen), lm_head from the verifier's draft rows."""
    dcfg = draft_model_config(cfg, len(t2d), len(d2t))
    torch.manual_seed(cfg.train.seed)
    model = Eagle3DraftModel(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(ckpt.read_verifier_tensor(cfg.verifier_path, "embed"))
        model.lm_head.weight.copy_(verifier_lm_head[torch.arange(len(d2t)) + d2t])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


def build_finetune_model(cfg: Config, d2t: torch.Tensor, t2d: torch.Tensor,
                         verifier_lm_head: torch.Tensor) -> tuple[Eagle3DraftModel, dict]:
    """The drafter at `train.finetune_from`, keys remapped and every tensor, the vocabulary map
    and the aux ids checked against ours; the base's attention geometry wins (ours is only
    derived). On resume the same model is rebuilt, then the step checkpoint is loaded."""
    from eagle3.vocab import remap_lm_head

    embed = ckpt.read_verifier_tensor(cfg.verifier_path, "embed")
    base = ckpt.load_base_drafter(Path(cfg.train.finetune_from))
    dcfg = ckpt.finetune_draft_config(draft_model_config(cfg, len(t2d), len(d2t)), base,
                                      intermediate_size=cfg.draft.intermediate_size)
    ckpt.check_base(base, dcfg, embed, d2t, t2d, allow_remap=cfg.vocab.allow_remap)
    ids = base.aux_ids_internal(cfg.export.sglang_aux_offset)
    ours = list(cfg.verifier_info.aux_layer_ids)
    if ids is not None and list(ids) != ours:
        raise StageError(f"base drafter {base.path} was trained on aux ids {base.aux_layer_ids} "
                         f"({base.layout} layout) = {list(ids)} as HF output_hidden_states "
                         f"indices, but the config resolves to {ours}: set "
                         f"verifier.aux_layer_ids={list(ids)} (and redo stage 02)")
    head = (remap_lm_head(base.weights["lm_head.weight"], base.d2t, d2t, verifier_lm_head)
            if cfg.vocab.allow_remap else None)
    model = Eagle3DraftModel(dcfg)
    model.load_state_dict(ckpt.base_state_dict(base, embed, d2t, t2d, head))
    info = {"path": str(base.path), "layout": base.layout,
            "aux_layer_ids_as_written": base.aux_layer_ids, "vocab_remapped": cfg.vocab.allow_remap}
    log.info("fine-tuning from %s (%s layout, aux ids %s)", base.path, base.layout,
             base.aux_layer_ids)
    return model, info


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    """Next micro-batch to read in `epoch` (the data position)."""
    tokens_seen: int = 0
    best_metric: float = -1.0
    best_step: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


class TTTObjective(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DistributedDataParallel can wrap it (DDP hooks
    the wrapped module's forward; the draft model's own entry points are `project`/`step`)."""

    def __init__(self, model: Eagle3DraftModel, ttt_steps: int, step_decay: float):
        super().__init__()
        self.model, self.ttt_steps, self.step_decay = model, ttt_steps, step_decay

    def forward(self, batch: Batch, teacher: Teacher) -> tuple[torch.Tensor, StepStats]:
        return ttt_forward(self.model, batch, teacher, self.ttt_steps, self.step_decay)


def _grad_sync(objective: torch.nn.Module, sync: bool) -> Any:
    """Context for one micro-batch's backward: reduce gradients over ranks only when `sync`
    (the step's last micro-batch); accumulate locally before."""
    if isinstance(objective, torch.nn.parallel.DistributedDataParallel) and not sync:
        return objective.no_sync()
    if hasattr(objective, "set_requires_gradient_sync"):  # FSDP2
        objective.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _sum_stats(stats: StepStats) -> StepStats:
    """Sum per-rank counts so every rank logs the global metrics (one process: unchanged)."""
    k = len(stats.loss)
    v = dist.all_reduce_sum(stats.loss + stats.counted + stats.correct + stats.full)
    return StepStats(v[:k], [int(x) for x in v[k:2 * k]], [int(x) for x in v[2 * k:3 * k]],
                     [int(x) for x in v[3 * k:]])


def _gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def run_train(stage: Stage) -> None:
    cfg = stage.cfg
    tc = cfg.train
    hs_manifest = stage.require(2)
    stage.require(3)
    if tc.tensorboard:
        _tensorboard_writer_class()  # fail on every rank before any work, not later on rank 0
    started = time.time()
    ctx = dist.init()
    device = ctx.device
    dtype = torch.float32  # fp32 master weights; bf16 compute under `train.autocast`
    bf16 = tc.autocast == "bf16" or (tc.autocast == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    data = HiddenStates(stage.upstream(2).dir)
    if not data.final_is_post_norm:
        raise StageError("02_hidden_states stored pre-norm final states; this trainer expects "
                         "post-norm (rerun 02_extract_hidden_states.py --restart)")
    if list(data.aux_layer_ids) != list(cfg.verifier_info.aux_layer_ids):
        raise StageError(f"02_hidden_states has aux ids {list(data.aux_layer_ids)} but the "
                         f"config resolves to {list(cfg.verifier_info.aux_layer_ids)}")
    d2t, t2d = load_vocab(stage.upstream(3).dir)
    lm_head = ckpt.read_verifier_tensor(cfg.verifier_path, "lm_head").to(device, dtype)
    draft_ids = (torch.arange(len(d2t)) + d2t).to(device)
    lengths = [data.num_tokens(i) for i in range(len(data))]
    train_idx, val_idx = split_indices(data.ids, tc.val_fraction, tc.seed)
    # One optimizer step consumes grad_accum micro-batches on every rank.
    per_step = tc.grad_accum * ctx.world_size
    per_epoch = len(epoch_batches(lengths, train_idx, tc.batch_tokens, tc.seed, 0))
    steps_per_epoch = math.ceil(per_epoch / per_step)
    total_steps = steps_per_epoch * tc.epochs
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)

    base_info: dict[str, Any] = {}
    if tc.finetune_from:
        model, base_info = build_finetune_model(cfg, d2t, t2d, lm_head.cpu())
    else:
        model = build_model(cfg, d2t, t2d, lm_head.cpu())
    model = model.to(device)
    model.lm_head.weight.requires_grad_(not tc.freeze_lm_head)
    state = TrainState()
    dcfg = model.cfg
    draft_meta = {**dcfg.to_dict(), "aux_layer_ids": list(cfg.verifier_info.aux_layer_ids)}

    if ctx.is_main:
        stage.dir.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(stage.dir)
    dist.barrier()
    latest = ckpt.find_latest(stage.dir)
    saved = None
    if latest is not None:
        weights, saved_meta, saved = ckpt.load_checkpoint(latest)
        if saved_meta != draft_meta:
            diff = [k for k in draft_meta if saved_meta.get(k) != draft_meta[k]]
            raise StageError(f"{latest} was trained with another draft shape ({diff}); "
                             f"rerun 04_train.py --restart to start over")
        if saved.get("world_size", 1) != ctx.world_size:
            raise StageError(f"{latest} was written by {saved.get('world_size', 1)} processes, "
                             f"this run has {ctx.world_size}: resume with the same world size")
        # Weights go in before any wrapping: every rank reads the same full checkpoint.
        model.load_state_dict({**weights, "embed_tokens.weight": model.embed_tokens.weight})

    parallel = tc.parallel if ctx.world_size > 1 else "none"
    objective: torch.nn.Module = TTTObjective(model, tc.ttt_steps, tc.step_decay)
    if parallel == "fsdp":
        dist.shard(objective)
    elif parallel == "ddp":
        # d2t/t2d are the only buffers and never change: no per-forward buffer broadcast.
        objective = torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, tc.warmup_ratio, tc.min_lr_ratio))
    if saved is not None:
        dist.load_optimizer_state(optimizer, saved["optimizer"], params)
        scheduler.load_state_dict(saved["scheduler"])
        state = TrainState(**saved["train_state"])
        ckpt.set_rng_state(saved["rng"][ctx.rank])
        log.info("resumed from %s (step %d, epoch %d, batch %d)", latest.name, state.step,
                 state.epoch, state.batch_in_epoch)
    if ctx.is_main:
        _truncate_metrics(stage.dir / "metrics.jsonl", state.step)

    n_params = sum(p.numel() for p in params)
    log.info("drafter: %d trainable parameters; %d train / %d val samples; %d steps "
             "(%d per epoch, %d micro-batches each over %d process(es)%s); ttt_steps %d",
             n_params, len(train_idx), len(val_idx), total_steps, steps_per_epoch, per_step,
             ctx.world_size, f", {parallel}" if ctx.world_size > 1 else "", tc.ttt_steps)
    tb = _tensorboard(stage.dir, state.step) if tc.tensorboard and ctx.is_main else None

    def validate() -> dict[str, Any]:
        objective.eval()
        stats = StepStats.zeros(tc.ttt_steps)
        groups = pack(lengths, val_idx, tc.batch_tokens)
        # Sharded weights are gathered inside the (FSDP) objective's forward, so under FSDP
        # every rank must run as many forwards: a rank short of batches repeats one, uncounted.
        forward = objective if parallel == "fsdp" else \
            (lambda b, t: ttt_forward(model, b, t, tc.ttt_steps, tc.step_decay))
        with torch.no_grad():
            for r in range(math.ceil(len(groups) / ctx.world_size)):
                i = r * ctx.world_size + ctx.rank
                group = groups[i] if i < len(groups) else groups[0]
                batch = collate([data[j] for j in group], tc.batch_tokens).to(device, dtype)
                teacher = make_teacher(batch.final, lm_head, draft_ids, teacher_rows(batch))
                with autocast:
                    s = forward(batch, teacher)[1]
                if i < len(groups):
                    stats.add(s)
        objective.train()
        return _sum_stats(stats).metrics()

    def save(val: dict[str, Any]) -> None:
        if val["est_accept_len"] > state.best_metric:
            state.best_metric, state.best_step = val["est_accept_len"], state.step
        rng = _gather(ckpt.rng_state(), ctx.world_size)  # every rank's generators, in rank order
        # Under FSDP gathering the full tensors is a collective: every rank takes part.
        weights = dist.full_tensors(model.trainable_state_dict())
        optimizer_state = dist.full_optimizer_state(optimizer)
        if ctx.is_main:
            trainer_state = {"optimizer": optimizer_state,
                             "scheduler": scheduler.state_dict(),
                             "train_state": state.state_dict(), "rng": rng,
                             "world_size": ctx.world_size}
            spec = speculators_config(dcfg, list(cfg.verifier_info.aux_layer_ids),
                                      str(cfg.verifier_path), cfg.verifier_info.architecture,
                                      speculative_tokens=min(3, tc.ttt_steps))
            path = ckpt.save_checkpoint(stage.dir, state.step, weights,
                                        spec, draft_meta, trainer_state)
            if state.best_step == state.step:
                ckpt.set_best(stage.dir, path)
            ckpt.prune(stage.dir, tc.keep)
        dist.barrier()

    objective.train()
    t_last, tok_last = time.time(), state.tokens_seen
    window = StepStats.zeros(tc.ttt_steps)
    batches, batches_epoch = [], -1
    while state.step < total_steps:
        if batches_epoch != state.epoch:
            batches = epoch_batches(lengths, train_idx, tc.batch_tokens, tc.seed, state.epoch)
            batches_epoch = state.epoch
        step_groups = batches[state.batch_in_epoch:state.batch_in_epoch + per_step]
        # Each micro-batch's loss is weighted so that the (rank-averaged) gradient is the mean
        # over all micro-batches of the step. Every rank runs the same number of micro-batches
        # (their collectives must pair up): one short of data at the end of an epoch repeats
        # one with weight 0.
        mine = step_groups[ctx.rank::ctx.world_size]
        n_micro = math.ceil(len(step_groups) / ctx.world_size)
        work = [(g, ctx.world_size / len(step_groups)) for g in mine] + \
            [(step_groups[0], 0.0)] * (n_micro - len(mine))
        optimizer.zero_grad(set_to_none=True)
        step_stats = StepStats.zeros(tc.ttt_steps)
        for n, (group, weight) in enumerate(work):
            batch = collate([data[i] for i in group], tc.batch_tokens).to(device, dtype)
            batch = training_targets(batch, tc.loss_on)
            teacher = make_teacher(batch.final, lm_head, draft_ids, teacher_rows(batch))
            with _grad_sync(objective, n == len(work) - 1), autocast:
                loss, s = objective(batch, teacher)
                (loss * weight).backward()
            if weight > 0:
                step_stats.add(s)
        state.tokens_seen += sum(min(lengths[i], tc.batch_tokens)
                                 for group in step_groups for i in group)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        state.step += 1
        state.batch_in_epoch += len(step_groups)
        if state.batch_in_epoch >= len(batches):
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        step_stats = _sum_stats(step_stats)
        window.add(step_stats)
        record = {"step": state.step, "epoch": state.epoch,
                  "loss": round(sum(tc.step_decay ** k * x / len(step_groups)
                                    for k, x in enumerate(step_stats.loss)), 5),
                  "lr": scheduler.get_last_lr()[0],
                  "grad_norm": round(dist.to_float(grad_norm), 4),
                  "tokens": state.tokens_seen, **step_stats.metrics()}
        val = None
        if state.step % tc.checkpoint_every == 0 or state.step == total_steps:
            val = validate() if val_idx else step_stats.metrics()
            record["val"] = val
        if ctx.is_main:
            _append_metrics(stage.dir / "metrics.jsonl", record)
            if tb is not None:
                _tensorboard_record(tb, record)
        if state.step % tc.log_every == 0 or val is not None:
            wm = window.metrics()
            dt = time.time() - t_last
            log.info("step %d/%d | loss %.4f | acc0 %.3f | est_len %.3f | lr %.2e | "
                     "%.0f tok/s%s", state.step, total_steps, record["loss"], wm["acc"][0],
                     wm["est_accept_len"], record["lr"],
                     (state.tokens_seen - tok_last) / max(dt, 1e-9),
                     f" | val est_len {val['est_accept_len']:.3f}" if val else "")
            window = StepStats.zeros(tc.ttt_steps)
            t_last, tok_last = time.time(), state.tokens_seen
        if val is not None:
            save(val)
            if tb is not None:
                tb.flush()

    if tb is not None:
        tb.close()
    dist.destroy()
    if not ctx.is_main:
        return
    latest = ckpt.find_latest(stage.dir)
    best = ckpt.read_pointer(stage.dir, "best") or latest
    final_val = json.loads((stage.dir / "metrics.jsonl").read_text().splitlines()[-1]).get("val")
    _plot_metrics(stage.dir)
    stage.write_manifest(
        inputs={"02_hidden_states": stage.upstream_hash(2), "03_vocab": stage.upstream_hash(3)},
        outputs={"latest": latest.name, "best": best.name, "metrics": "metrics.jsonl"},
        counts={"steps": state.step, "tokens_seen": state.tokens_seen,
                "train_samples": len(train_idx), "val_samples": len(val_idx),
                "trainable_parameters": n_params, "best_step": state.best_step,
                "parallel": parallel,
                "best_val_est_accept_len": state.best_metric, "world_size": ctx.world_size,
                "aux_layer_ids": list(cfg.verifier_info.aux_layer_ids),
                "final_state": hs_manifest.get("counts", {}).get("final_state", "post_norm")},
        started=started, final_val=final_val, finetune_from=base_info or None)


def _append_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
            elif key in ("loss", "lr", "grad_norm", "est_accept_len", "tokens"):
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
