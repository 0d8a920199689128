"""The training-time-test (TTT) objective of EAGLE-3: teacher, unrolled loss, metrics.

Alignment (docs/engines.md, "Training"). For a document x_0..x_{L-1} with aux states g_t and
the verifier's final states f_t, TTT step k at position t:
    input token  x_{t+1+k}, hidden = the draft's own pre-norm output of step k-1 (fc(g_t) at 0)
    target       x_{t+2+k}; teacher = softmax over the draft vocabulary of lm_head(f_{t+1+k})
    RoPE         position t + k; attends to step-0 keys <= t (same document) and to its own
                 earlier steps' keys at t
    counted      when x_{t+2+k} is inside the document and loss_mask[t+2+k] = 1 (in training
                 with `train.loss_on=all`, every position: prompts too; never in validation)
The loss of step k is the soft cross-entropy against the teacher over positions counted whose
teacher argmax lies in the draft vocabulary, divided by the positions counted; steps are
weighted step_decay**k and summed (the weighting lives in `ttt_forward` only). Metrics: acc_k
(draft argmax == verifier argmax), full_acc_k (steps 0..k all right, over chains started at
step-0-counted positions), and the estimated acceptance length 1 + sum_k full_acc_k.

    batch, teacher = prepare_batch(samples, budget, device, dtype, lm_head, draft_ids)
    loss, stats = ttt_forward(model, batch, teacher, ttt_steps=3, step_decay=0.8)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from eagle3 import dist
from eagle3.model import Eagle3DraftModel, causal_doc_mask
from eagle3.shards import Batch, collate


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


def training_targets(batch: Batch, loss_on: str) -> Batch:
    """The batch whose `loss_mask` training uses: unchanged for `assistant`; every position for
    `all`. Prompt positions still have the verifier's distribution as their teacher, so they add
    signal without any extra generation or extraction; validation never calls this."""
    if loss_on == "all":
        return dataclasses.replace(batch, loss_mask=torch.ones_like(batch.loss_mask))
    return batch


def prepare_batch(samples: list[dict[str, torch.Tensor]], budget: int, device: torch.device,
                  dtype: torch.dtype, lm_head: torch.Tensor, draft_ids: torch.Tensor,
                  loss_on: Optional[str] = None) -> tuple[Batch, Teacher]:
    """Samples -> (packed batch on `device`, its teacher). `loss_on` (training only) widens the
    trained positions; None keeps the assistant mask (validation, benchmarks)."""
    batch = collate(samples, budget).to(device, dtype)
    if loss_on is not None:
        batch = training_targets(batch, loss_on)
    return batch, make_teacher(batch.final, lm_head, draft_ids, teacher_rows(batch))


@dataclass
class StepStats:
    """Summed over positions, micro-batches and ranks, so metrics aggregate exactly."""
    loss: list[float]
    """Per TTT step: the step's loss, summed over micro-batches."""
    counted: list[int]
    correct: list[int]
    full: list[int]
    objective: float = 0.0
    """The weighted loss that was backpropagated, summed over micro-batches."""
    batches: int = 0

    @classmethod
    def zeros(cls, k: int) -> "StepStats":
        return cls([0.0] * k, [0] * k, [0] * k, [0] * k)

    def add(self, other: "StepStats") -> None:
        for name in ("loss", "counted", "correct", "full"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for i in range(len(mine)):
                mine[i] += theirs[i]
        self.objective += other.objective
        self.batches += other.batches

    def summed(self) -> "StepStats":
        """These counts summed over all ranks (a collective; one process: unchanged)."""
        k = len(self.loss)
        v = dist.all_reduce_sum(self.loss + self.counted + self.correct + self.full
                                + [self.objective, self.batches])
        ints = lambda xs: [int(x) for x in xs]  # noqa: E731
        return StepStats(v[:k], ints(v[k:2 * k]), ints(v[2 * k:3 * k]), ints(v[3 * k:4 * k]),
                         v[4 * k], int(v[4 * k + 1]))

    def metrics(self) -> dict[str, Any]:
        chains = max(self.counted[0], 1)
        full_acc = [f / chains for f in self.full]
        out = {
            "loss": self.objective / max(self.batches, 1),
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
    stats.objective, stats.batches = float(total.detach()), 1
    return total, stats


class TTTObjective(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DistributedDataParallel can wrap it (DDP hooks
    the wrapped module's forward; the draft model's own entry points are `project`/`step`)."""

    def __init__(self, model: Eagle3DraftModel, ttt_steps: int, step_decay: float):
        super().__init__()
        self.model, self.ttt_steps, self.step_decay = model, ttt_steps, step_decay

    def forward(self, batch: Batch, teacher: Teacher) -> tuple[torch.Tensor, StepStats]:
        return ttt_forward(self.model, batch, teacher, self.ttt_steps, self.step_decay)
