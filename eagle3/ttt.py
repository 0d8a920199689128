"""The training-time-test (TTT) objective of EAGLE-3: teacher, unrolled loss, metrics.

Alignment (docs/engines.md, "Training"). For a document x_0..x_{L-1} with aux states g_t and
the verifier's final states f_t, TTT step k at position t:
    input token  x_{t+1+k}, hidden = the draft's own pre-norm output of step k-1 (fc(g_t) at 0)
    target       x_{t+2+k}; teacher = softmax over the draft vocabulary of lm_head(f_{t+1+k})
    RoPE         position t + k; attends to step-0 keys <= t (same document) and to its own
                 earlier steps' keys at t
    counted      when x_{t+2+k} is inside the document and loss_mask[t+2+k] = 1 (in training
                 with `train.loss_on=all`, every position: prompts too; never in validation)
The loss of step k is taken over positions counted whose teacher argmax lies in the draft
vocabulary, divided by the positions counted; steps are weighted step_decay**k and summed (the
weighting lives in `ttt_forward` only). Per position, with q the draft's distribution over the
draft vocabulary V_d, p~ the teacher renormalized over V_d and p the verifier's full-vocabulary
distribution restricted to V_d (not renormalized):
    kl         soft cross-entropy -sum p~ log q (= KL(p~ || q) + a constant)
    lk_alpha   -log alpha, alpha = sum_x min(p(x), q(x)): the acceptance probability of
               speculative sampling at this position (Leviathan et al. 2023: 1 - TV(p, q));
               the LK^alpha loss of Samarin et al. 2026 (arXiv 2602.23881, "LK losses")
    lk_lambda  lambda KL(p~ || q) + (1 - lambda)(1 - alpha), lambda = exp(-eta sg[mean alpha])
               per step over the counted positions of all ranks (their LK^lambda; eta = 3)
Metrics: acc_k (draft argmax == verifier argmax), full_acc_k (steps 0..k all right, over chains
started at step-0-counted positions), the estimated acceptance length 1 + sum_k full_acc_k
(greedy serving) and, at a sampling temperature T, the expected one: 1 + sum_k of the mean over
chains of prod_{j<=k} a_j, with a_j = alpha at temperature T when drafts are sampled from q
(`est_accept_len_sampled`), or a_j = p_T(argmax q) when the engine drafts greedily and accepts
a draft with the verifier's probability of it, as vLLM does (`est_accept_len_greedy_draft`).

    batch, teacher = prepare_batch(samples, budget, device, dtype,
                                   VerifierHead.of(lm_head, draft_ids))
    loss, stats = ttt_forward(model, batch, teacher, TTTSpec(ttt_steps=3, step_decay=0.8))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Optional

import torch
import torch.utils.checkpoint

from eagle3 import dist
from eagle3.model import Eagle3DraftModel, causal_doc_mask
from eagle3.shards import Batch, collate
from eagle3.teacher import Teacher, TeacherCache, VerifierHead, document_stats, make_teacher

if TYPE_CHECKING:
    from eagle3.config import TrainConfig


LOSSES = ("kl", "lk_alpha", "lk_lambda")


@dataclass(frozen=True)
class TTTSpec:
    """What TTT unrolls and minimises: one value, built once from the config (`of`), that
    training, validation and the benchmarks hand to `ttt_forward` alike."""
    ttt_steps: int
    step_decay: float
    """Loss weight of step k is step_decay**k."""
    loss: str = "kl"
    """One of LOSSES (`train.loss`)."""
    lk_eta: float = 3.0
    """LK^lambda's eta (`train.lk_eta`)."""
    reach: str = "off"
    """`train.reach_weight`: off | greedy | sampled (see `ttt_forward`)."""
    kl_temperature: float = 1.0
    """The KL target is the verifier's draft-vocabulary softmax at this temperature."""
    checkpoint_steps: bool = False
    """`train.activation_checkpointing`: keep only each TTT step's inputs and outputs for
    backward and recompute the step there (see `_checkpointed_step`)."""

    @classmethod
    def of(cls, tc: "TrainConfig") -> "TTTSpec":
        return cls(tc.ttt_steps, tc.step_decay, tc.loss, tc.lk_eta, tc.reach_weight,
                   tc.kl_temperature, tc.activation_checkpointing)


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
                  dtype: torch.dtype, head: VerifierHead, loss_on: Optional[str] = None,
                  temperature: Optional[float] = None, keys: Optional[list[Hashable]] = None,
                  cache: Optional[TeacherCache] = None) -> tuple[Batch, Teacher]:
    """Samples -> (packed batch on `device`, its teacher). `loss_on` (training only) widens the
    trained positions; None keeps the assistant mask (validation, benchmarks). `temperature`:
    see `make_teacher`. With a `cache`, `keys` name the samples (one each) so their
    full-vocabulary statistics are computed once per run (`eagle3.teacher`); a full head reads
    them off its draft logits instead and needs no cache."""
    batch = collate(samples, budget).to(device, dtype)
    if loss_on is not None:
        batch = training_targets(batch, loss_on)
    needed = teacher_rows(batch)
    stats = None if head.is_full else document_stats(
        batch.final, batch.doc_end, needed, head, temperature,
        None if keys is None else [(k, loss_on, temperature) for k in keys], cache)
    return batch, make_teacher(batch.final, head, needed, temperature, stats)


@dataclass
class StepStats:
    """Summed over positions, micro-batches and ranks, so metrics aggregate exactly."""
    loss: list[float]
    """Per TTT step: the step's loss, summed over micro-batches."""
    counted: list[int]
    correct: list[int]
    full: list[int]
    alpha: list[float] = dataclasses.field(default_factory=list)
    """Per step: sum over counted positions of the acceptance probability alpha (T = 1)."""
    expected: list[float] = dataclasses.field(default_factory=list)
    """Per step k: sum over chains of prod_{j<=k} alpha_j at the estimate's temperature."""
    expected_greedy: list[float] = dataclasses.field(default_factory=list)
    """The same with a_j = p_T(the draft's argmax): greedy drafting."""
    objective: float = 0.0
    """The weighted loss that was backpropagated, summed over micro-batches."""
    batches: int = 0
    temperature: Optional[float] = None
    """The sampled estimate's temperature (None: greedy estimate only)."""

    @classmethod
    def zeros(cls, k: int, temperature: Optional[float] = None) -> "StepStats":
        return cls([0.0] * k, [0] * k, [0] * k, [0] * k, [0.0] * k, [0.0] * k, [0.0] * k,
                   temperature=temperature)

    def add(self, other: "StepStats") -> None:
        for name in ("loss", "counted", "correct", "full", "alpha", "expected",
                     "expected_greedy"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for i in range(len(mine)):
                mine[i] += theirs[i]
        self.objective += other.objective
        self.batches += other.batches
        self.temperature = self.temperature or other.temperature

    def summed(self) -> "StepStats":
        """These counts summed over all ranks (a collective; one process: unchanged)."""
        k = len(self.loss)
        v = dist.all_reduce_sum(self.loss + self.counted + self.correct + self.full
                                + self.alpha + self.expected + self.expected_greedy
                                + [self.objective, self.batches])
        ints = lambda xs: [int(x) for x in xs]  # noqa: E731
        return StepStats(v[:k], ints(v[k:2 * k]), ints(v[2 * k:3 * k]), ints(v[3 * k:4 * k]),
                         v[4 * k:5 * k], v[5 * k:6 * k], v[6 * k:7 * k], v[7 * k],
                         int(v[7 * k + 1]), self.temperature)

    def metrics(self) -> dict[str, Any]:
        chains = max(self.counted[0], 1)
        full_acc = [f / chains for f in self.full]
        out = {
            "loss": self.objective / max(self.batches, 1),
            "acc": [c / max(n, 1) for c, n in zip(self.correct, self.counted)],
            "full_acc": full_acc,
            "cond_acc": [self.full[0] / chains] + [
                self.full[k] / max(self.full[k - 1], 1) for k in range(1, len(self.full))],
            "alpha": [a / max(n, 1) for a, n in zip(self.alpha, self.counted)],
            "est_accept_len": 1.0 + sum(full_acc),
        }
        if self.temperature:
            out["est_accept_len_sampled"] = 1.0 + sum(e / chains for e in self.expected)
            out["est_accept_len_greedy_draft"] = 1.0 + sum(e / chains
                                                           for e in self.expected_greedy)
            out["sampled_temperature"] = self.temperature
        return {k: ([round(x, 5) for x in v] if isinstance(v, list) else round(v, 5))
                for k, v in out.items()}


def acceptance_probability(draft_logits: torch.Tensor, teacher_logits: torch.Tensor,
                           lse: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """alpha = sum_{x in V_d} min(p(x), q(x)) per position: q = softmax(draft_logits / T) over
    the draft vocabulary, p = the verifier's full-vocabulary softmax at T restricted to V_d
    (`exp(teacher_logits / T - lse)`, `lse` its full log-normalizer at T): the probability that
    speculative sampling accepts the draft's token (LK paper eq. for the acceptance rate; at
    most p(V_d), the verifier's mass the drafter can propose). Two [.., V_d] float32 buffers,
    updated in place: `lk_lambda` runs this over every row of every TTT step before its loss."""
    z, t = draft_logits.float(), teacher_logits.float()
    q = torch.softmax(z / temperature if temperature != 1.0 else z, dim=-1)
    p = (torch.div(t, temperature).sub_(lse[..., None]) if temperature != 1.0 else
         torch.sub(t, lse[..., None]))
    p.exp_()
    # in q's buffer unless autograd needs q (the tests' reference losses differentiate this)
    return (torch.minimum(p, q) if q.requires_grad or p.requires_grad else
            torch.minimum(p, q, out=q)).sum(-1)


LOSS_CHUNK: Optional[int] = None
"""Token rows per chunk of a step's loss (None: `_chunk_rows` picks by device): the float32
[chunk, V_draft] buffers of one chunk exist at a time; backward keeps the logits' gradient only
(`StepLoss`)."""

LOSS_CHUNK_BYTES = {"cpu": 8 << 20, "default": 512 << 20}
"""One float32 [chunk, V_draft] buffer's size. On a CPU, small: glibc returns blocks over 32 MiB
to the OS on free, and every fresh one costs page faults as long as a pass over it (256 rows
of 8,192 were 10% faster a step than 2,048 in bench/bench_train.py); on a GPU, large, for few
kernel launches (the caching allocator reuses blocks)."""


def _chunk_rows(logits: torch.Tensor) -> int:
    if LOSS_CHUNK:
        return LOSS_CHUNK
    budget = LOSS_CHUNK_BYTES.get(logits.device.type, LOSS_CHUNK_BYTES["default"])
    return max(16, budget // (4 * logits.shape[-1]))


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The loss math runs in float32 at least (bf16 logits are upcast; float64 tests stay)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _teacher_probs(t_logits: torch.Tensor, t_lse: torch.Tensor, temperature: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """p~ = softmax(t_logits / temperature) over the draft vocabulary, from its per-row
    log-normalizer `t_lse` (computed once per micro-batch: every TTT step reads the same rows)."""
    t = t_logits.to(dtype)
    t = t / temperature if temperature != 1.0 else t
    return torch.sub(t, t_lse[..., None].to(dtype)).exp_()


ALPHA_FLOOR = 1e-5
"""`lk_alpha` takes -log max(alpha, floor): alpha = 0 (no overlap) would give an infinite loss
(speculators clamps at 1e-5 too); below the floor a position has no gradient."""


class StepLoss(torch.autograd.Function):
    """The loss of one TTT step, sum_t w_t * loss_t for `loss` in `LOSSES`, and each row's
    acceptance probability alpha (not differentiated), in `_chunk_rows` rows at a time.

    Written out rather than left to autograd because it is most of a step's elementwise work
    (autograd through softmax, log-softmax and min kept or recomputed a dozen [T, V_d] float32
    buffers per chunk: at a full 49,152-row vocabulary the LK losses took 17-20 s of a 19-22 s
    TTT unroll, bench/RESULTS.md "The step loss written out"). With q = softmax(z) and the
    loss a scalar, forward computes the gradient while it has q and p~ at hand, and backward
    only scales it. Per row, with g(x) = 1[q(x) < p(x)] (where min(p, q) follows q) and
    S = sum_x g(x) q(x):
        kl         -sum p~ log q = logsumexp(z) - p~ . z         d/dz = q - p~
        alpha      sum_x min(p(x), q(x))                          d/dz = q (g - S)
        lk_alpha   -log max(alpha, floor)                         d/dz = -q (g - S) / alpha
        lk_lambda  lam KL(p~ || q) + (1 - lam)(1 - alpha)         d/dz = lam (q - p~)
                   KL = logsumexp(z) - t_lse + p~ . (t / tau - z)        - (1 - lam) q (g - S)
    (sum p~ = 1 over the draft vocabulary; t / tau - t_lse = log p~; `lam` is detached, a
    constant here; where p = q, torch.minimum's autograd would split the gradient, here it
    follows p: a measure-zero difference). What is kept for backward is that gradient, in the
    logits' dtype, in place of the logits themselves; no teacher row is gathered: a step's
    teacher rows are a view.

    Inputs: logits [B, T, Vd] (rows n.. carry no loss: the step's source lies past the batch),
    the teacher's draft logits, its draft log-normalizer at `temperature` (the KL temperature;
    unused by `lk_alpha`) and its full log-normalizer for rows 0..n-1 of this step, weight
    [B, T], and `lam` (a 0-d tensor; `lk_lambda` only)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, t_logits: torch.Tensor, t_lse: torch.Tensor,
                lse: torch.Tensor, weight: torch.Tensor, temperature: float, loss: str,
                lam: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, n = logits.shape[0], logits.shape[1], t_logits.shape[1]
        dtype, chunk = _loss_dtype(logits), _chunk_rows(logits)
        alpha = logits.new_zeros(B, T, dtype=dtype)
        total = logits.new_zeros((), dtype=dtype)
        lam = lam.to(dtype) if lam is not None else None
        grad = None
        if ctx.needs_input_grad[0]:
            grad = torch.empty_like(logits)
            grad[:, n:] = 0
        # float32 throughout, whatever autocast would make of the dot products below
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = logits[:, s:e].to(dtype)
                # softmax and logsumexp from one exp pass; buffers updated in place (on a CPU a
                # fresh [chunk, V_d] buffer costs as much as a pass: its pages fault in)
                top = z.amax(-1, keepdim=True)
                q = torch.sub(z, top).exp_()
                total_q = q.sum(-1, keepdim=True)
                lz = (top + total_q.log()).squeeze(-1)
                q /= total_q
                w = weight[:, s:e].to(dtype)
                p_tilde = (_teacher_probs(t_logits[:, s:e], t_lse[:, s:e], temperature, dtype)
                           if loss != "lk_alpha" else None)
                # p = exp(t - lse); at temperature 1 that is p~ scaled per row by exp(t_lse - lse)
                # (in p~'s buffer where p~ is done with: one pass instead of two)
                to_p = (torch.exp(t_lse[:, s:e] - lse[:, s:e])[..., None].to(dtype)
                        if temperature == 1.0 and p_tilde is not None else None)
                if loss == "kl":
                    total += ((lz - torch.linalg.vecdot(p_tilde, z)) * w).sum()
                    if grad is not None:
                        grad[:, s:e] = (q - p_tilde).mul_(w[..., None])
                    p = (p_tilde.mul_(to_p) if to_p is not None else
                         torch.exp(t_logits[:, s:e].to(dtype) - lse[:, s:e, None].to(dtype)))
                    a = torch.minimum(p, q, out=q).sum(-1)
                else:
                    p = (p_tilde * to_p if to_p is not None else
                         torch.exp(t_logits[:, s:e].to(dtype) - lse[:, s:e, None].to(dtype)))
                    g = torch.lt(q, p) if grad is not None else None
                    a = torch.minimum(p, q, out=p).sum(-1)
                    if loss == "lk_alpha":
                        a_floor = a.clamp(min=ALPHA_FLOOR)
                        total += (-torch.log(a_floor) * w).sum()
                        scale = torch.where(a >= ALPHA_FLOOR, -w / a_floor, 0.0)  # of d alpha
                    else:  # lk_lambda
                        t = t_logits[:, s:e].to(dtype)
                        p_t = torch.linalg.vecdot(p_tilde, t)
                        kl = (lz - t_lse[:, s:e].to(dtype) - torch.linalg.vecdot(p_tilde, z)
                              + (p_t / temperature if temperature != 1.0 else p_t))
                        total += ((lam * kl + (1 - lam) * (1 - a)) * w).sum()
                        scale = (lam - 1) * w
                    if grad is not None:
                        # d alpha = q (g - S), built in p's buffer, scaled per row
                        d_alpha = torch.mul(q, g, out=p)
                        d_alpha.addcmul_(q, d_alpha.sum(-1, keepdim=True), value=-1)
                        d_alpha.mul_(scale[..., None])
                        if loss == "lk_lambda":  # + lam w (q - p~)
                            d_alpha.add_(q.sub_(p_tilde).mul_((lam * w)[..., None]))
                        grad[:, s:e] = d_alpha
                alpha[:, s:e] = a
        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(alpha)
        return total, alpha

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_alpha: torch.Tensor
                 ) -> tuple[Optional[torch.Tensor], ...]:
        grad, = ctx.saved_tensors
        return (grad * grad_total.to(grad.dtype),) + (None,) * 7


def step_loss(spec: TTTSpec, logits: torch.Tensor, t_logits: torch.Tensor, t_lse: torch.Tensor,
              lse: torch.Tensor, weight: torch.Tensor, n: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of one TTT step, alpha per position, detached). `logits` [B, T, V_d]; the
    teacher's rows for this step's positions 0..n'-1 (`t_logits` [B, n', V_d], their draft
    log-normalizer at the KL temperature `t_lse` and full log-normalizer `lse`, [B, n']) are
    views of the micro-batch's teacher; positions n'.. read no teacher and carry no weight.
    `weight` [B, T] marks the positions that count (the counted ones whose teacher argmax is in
    the draft vocabulary), `n` the counted positions (the normaliser of every loss, as for KL).

    Memory: the loss runs over `_chunk_rows` token rows at a time and backward keeps only the
    logits' gradient (`StepLoss`), never a float32 [T, V_d] softmax (keeping them cost ~17 bytes
    per draft-vocabulary row, token and TTT step: about 60 GB for a 16k-token Kimi micro-batch
    at TTT 7; bench/RESULTS.md "Training memory")."""
    if spec.loss not in LOSSES:
        raise ValueError(f"unknown TTT loss {spec.loss!r}: one of {', '.join(LOSSES)}")
    lam = None
    if spec.loss == "lk_lambda":  # lambda needs every position's alpha first: one extra pass
        with torch.no_grad():
            alpha = logits.new_zeros(logits.shape[:2], dtype=torch.float32)
            rows, chunk = t_logits.shape[1], _chunk_rows(logits)
            for s in range(0, rows, chunk):
                e = min(s + chunk, rows)
                alpha[:, s:e] = acceptance_probability(logits[:, s:e], t_logits[:, s:e],
                                                       lse[:, s:e])
            # on the device, summed over ranks: no host sync
            sums = dist.all_reduce_tensor(torch.stack([(alpha * weight).sum().double(),
                                                       n.double()]))
            lam = torch.exp(-spec.lk_eta * sums[0] / sums[1].clamp(min=1.0))
    total, alpha = StepLoss.apply(logits, t_logits, t_lse, lse, weight, spec.kl_temperature,
                                  spec.loss, lam)
    return total.float() / n.clamp(min=1), alpha.float()


def _plain_step(model: Eagle3DraftModel, h: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, mask: Any, cache: list[list[Any]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return model.step(h, input_ids, positions, mask, cache)


def _checkpointed_step(model: Eagle3DraftModel, h: torch.Tensor, input_ids: torch.Tensor,
                       positions: torch.Tensor, mask: Any, cache: list[list[Any]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.step` under activation checkpointing: backward keeps the step's input hidden
    state, its keys/values (later steps attend to them) and its logits (the loss reads them),
    and recomputes everything in between (the MLP, norms, projections). The recomputation
    runs on a copy of the cache as it was when the step ran, so it sees the same keys."""
    before = [list(layer) for layer in cache]

    def run(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local = [list(layer) for layer in before]
        h, logits = model.step(h, input_ids, positions, mask, local)
        return (h, logits) + tuple(t for layer in local for t in layer[-1])

    h, logits, *kv = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False)
    for layer, i in zip(cache, range(0, len(kv), 2)):
        layer.append((kv[i], kv[i + 1]))
    return h, logits


def p_tilde_normalizer(teacher: Teacher, spec: TTTSpec) -> torch.Tensor:
    """The `t_lse` that `step_loss` takes, per row [B, T]: logsumexp over the draft vocabulary of
    the teacher's logits / the KL temperature, once per micro-batch (`_chunk_rows` rows at a
    time) for every TTT step's p~; `lk_alpha` reads no p~ and gets the full lse unchanged."""
    if spec.loss == "lk_alpha":
        return teacher.lse
    draft_logits, temperature = teacher.draft_logits, spec.kl_temperature
    dtype, chunk = _loss_dtype(draft_logits), _chunk_rows(draft_logits)
    out = draft_logits.new_empty(draft_logits.shape[:-1], dtype=dtype)
    for s in range(0, draft_logits.shape[1], chunk):
        t = draft_logits[:, s:s + chunk].to(dtype)
        out[:, s:s + chunk] = torch.logsumexp(t / temperature if temperature != 1.0 else t,
                                              dim=-1)
    return out


def ttt_forward(model: Eagle3DraftModel, batch: Batch, teacher: Teacher, spec: TTTSpec,
                estimate_temperature: Optional[float] = None) -> tuple[torch.Tensor, StepStats]:
    """Unroll `spec.ttt_steps` draft steps on a packed batch; return (weighted loss, counts).
    `estimate_temperature` (needs a teacher made with that temperature) adds the expected
    acceptance under sampling at T. `spec.reach` (`train.reach_weight`) also weights step k's
    loss per position by the chance that serving drafts step k there: `greedy`, 1 where steps
    0..k-1 drafted the verifier's argmax, else 0 (GRIFFIN's loss masking, arXiv 2502.11018,
    for chain drafts); `sampled`, the product of their acceptance probabilities alpha."""
    T = batch.num_tokens
    idx = torch.arange(T, device=batch.input_ids.device)[None]
    mask = causal_doc_mask(batch.doc_ids)
    cache = model.new_cache()
    h = model.project(batch.aux)
    alive = chain_p = chain_g = reached = None
    total = h.new_zeros(())
    stats = StepStats.zeros(spec.ttt_steps, estimate_temperature)
    t_lse = p_tilde_normalizer(teacher, spec)
    per_step: list[list[torch.Tensor]] = []  # per step: loss, counted, correct, full, alpha,
    for k in range(spec.ttt_steps):           # expected, expected_greedy (device scalars)
        src = idx + 1 + k                      # position of the input token (and its teacher)
        tgt = src + 1                          # position of the predicted token
        in_doc = src < batch.doc_end
        src_c, tgt_c = src.clamp(max=T - 1), tgt.clamp(max=T - 1)
        input_ids = torch.where(in_doc, batch.input_ids.gather(1, src_c), 0)
        counted = (tgt < batch.doc_end) & batch.loss_mask.gather(1, tgt_c)
        step = _checkpointed_step if spec.checkpoint_steps and torch.is_grad_enabled() \
            else _plain_step
        h, logits = step(model, h, input_ids, batch.positions + k, mask, cache)

        t_argmax = teacher.argmax.gather(1, src_c)
        weight = (counted & model.t2d[t_argmax]).float()
        if reached is not None:
            weight = weight * reached
        n = counted.sum()
        rows = slice(1 + k, None)  # teacher rows src = t + 1 + k of positions t < T - 1 - k
        loss_k, alpha = step_loss(spec, logits, teacher.draft_logits[:, rows], t_lse[:, rows],
                                  teacher.lse[:, rows], weight, n)
        total = total + (spec.step_decay ** k) * loss_k
        if spec.reach != "off":
            here = (alpha if spec.reach == "sampled" else
                    (model.draft_to_target(logits.detach().argmax(-1)) == t_argmax).float())
            reached = here if reached is None else reached * here

        with torch.no_grad():
            correct = counted & (model.draft_to_target(logits.argmax(-1)) == t_argmax)
            if alive is None:
                alive, chains = correct, counted
            else:
                alive = alive & correct
            zero = loss_k.new_zeros((), dtype=torch.float64)
            per_step.append([loss_k.detach().double(), n.double(), correct.sum().double(),
                             (alive & chains).sum().double(), (alpha * counted).sum().double(),
                             zero, zero])
            if estimate_temperature:
                lse_t, t_logits = teacher.lse_t[:, rows], teacher.draft_logits[:, rows]
                m = t_logits.shape[1]
                a_t = torch.zeros_like(alpha)
                a_t[:, :m] = acceptance_probability(logits[:, :m], t_logits, lse_t,
                                                    estimate_temperature)
                g_t = torch.zeros_like(alpha)
                g_t[:, :m] = torch.exp(t_logits.float().gather(
                    -1, logits[:, :m].argmax(-1, keepdim=True)).squeeze(-1)
                    / estimate_temperature - lse_t)
                a_t, g_t = a_t * counted, g_t * counted
                chain_p = a_t if chain_p is None else chain_p * a_t
                chain_g = g_t if chain_g is None else chain_g * g_t
                per_step[-1][5:] = [(chain_p * chains).sum().double(),
                                    (chain_g * chains).sum().double()]
    # The counts cross to the host once per micro-batch, not once per step and metric.
    values = torch.stack([torch.stack(v) for v in per_step]
                         + [total.detach().double().expand(7)]).tolist()
    for k, (loss_k, n, correct, full, alpha, expected, greedy) in enumerate(values[:-1]):
        stats.loss[k], stats.counted[k], stats.correct[k], stats.full[k] = \
            loss_k, int(n), int(correct), int(full)
        stats.alpha[k], stats.expected[k], stats.expected_greedy[k] = alpha, expected, greedy
    stats.objective, stats.batches = values[-1][0], 1
    return total, stats


class TTTObjective(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DistributedDataParallel can wrap it (DDP hooks
    the wrapped module's forward; the draft model's own entry points are `project`/`step`)."""

    def __init__(self, model: Eagle3DraftModel, spec: TTTSpec):
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, batch: Batch, teacher: Teacher,
                estimate_temperature: Optional[float] = None) -> tuple[torch.Tensor, StepStats]:
        return ttt_forward(self.model, batch, teacher, self.spec, estimate_temperature)
