"""The EAGLE-3 draft model, in one file: config, layers, and the training-time-test step.

Shapes follow the checkpoints the engines load (docs/engines.md, "The draft model"). Parameter names are
the speculators/vLLM-internal ones (`layers.0.*`); `eagle3/formats.py` maps them to `midlayer.*`
for SGLang. One draft step:

    h0 = fc(cat(aux_1..aux_n))                      # [T, H] from the verifier's aux states
    layer 0:  residual = h; x = cat(input_layernorm(embed(tok)), hidden_norm(h))
              h = residual + attn(x); h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                       # draft vocabulary; target id = i + d2t[i]
    the pre-norm h is the next step's hidden input.

With `norm_before_residual` the residual is `hidden_norm(h)` instead (speculators' default;
SGLang cannot serve it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


ADDED_LATER: dict[str, Any] = {
    "fc_norm": False, "norm_output": False, "attention": "mha", "q_lora_rank": None,
    "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0,
    "rope_scaling": None}
"""DraftModelConfig fields a checkpoint written before them lacks, with the value it was trained
with."""


@dataclass(frozen=True)
class DraftModelConfig:
    hidden_size: int
    """Drafter width; must equal the verifier's embedding width (the embedding is shared)."""
    target_hidden_size: int
    """Verifier hidden size (width of each aux state)."""
    num_aux: int
    """Aux states concatenated into `fc` (3 for EAGLE-3)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    """Verifier vocabulary (rows of the frozen embedding)."""
    draft_vocab_size: int
    """Rows of `lm_head`; equal to `vocab_size` for a full-vocabulary head (`full_vocab`)."""
    norm_before_residual: bool = False
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm of its own on each aux state before `fc` (`fc_norm.<i>.weight`)."""
    norm_output: bool = False
    """EAGLE-3.1: the next step reads the post-norm hidden state (the one `lm_head` reads)."""
    attention: str = "mha"
    """`mha`: Llama attention (q/k/v_proj, `head_dim`). `mla`: DeepSeek-V2 multi-head latent
    attention (`MLAttention`, the dimensions below), served as `Eagle3DeepseekV2ForCausalLM`
    (docs/engines.md "MLA draft layer")."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query down-projection (`q_a_proj`); None projects queries directly
    (`q_proj`, which SGLang cannot serve)."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent (`kv_a_proj_with_mqa`)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (one key part shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    rope_scaling: Optional[dict[str, Any]] = None
    """YaRN (`{"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim"}`); None: plain RoPE. MLA: DeepSeek's, as vLLM's and
    SGLang's `deepseek_yarn` apply it (the verifier's own for Kimi). MHA: the engines' Llama
    YaRN (a base's, e.g. lightseekorg's kimi-k2.5-eagle3), which turns the same frequencies
    with the same magnitude and leaves the softmax scale alone (docs/engines.md "YaRN")."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention={self.attention!r}: use mha or mla")
        if self.attention == "mla":
            dims = {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                    "v_head_dim": self.v_head_dim}
            bad = [k for k, v in dims.items() if not (isinstance(v, int) and v > 0)]
            if bad or self.qk_nope_head_dim < 0 or self.qk_rope_head_dim % 2:
                raise ValueError(f"an MLA layer needs positive kv_lora_rank, v_head_dim and an "
                                 f"even qk_rope_head_dim, qk_nope_head_dim >= 0: got {dims}, "
                                 f"qk_nope_head_dim={self.qk_nope_head_dim}")
        if self.rope_scaling is not None:
            problem = yarn_problem(self.rope_scaling, self.attention)
            if problem:
                raise ValueError(f"rope_scaling {self.rope_scaling}: {problem}")

    @property
    def rope_dim(self) -> int:
        """Width the rotary embedding turns: the whole head, or MLA's rope part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def full_vocab(self) -> bool:
        """The head covers the verifier's whole vocabulary: draft id i is target id i, and no
        d2t/t2d ships (vLLM has nothing to load them into; docs/engines.md "Full
        vocabulary")."""
        return self.draft_vocab_size == self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftModelConfig":
        """Exactly the fields of this class: an unknown or missing one is an error (a silent
        default of e.g. norm_before_residual would build another model)."""
        names = {f.name for f in dataclasses.fields(cls)}
        # fields added after checkpoints were written: absent means the drafter lacked them
        d = {**ADDED_LATER, **d}
        unknown, missing = set(d) - names, names - set(d)
        if unknown or missing:
            raise ValueError(f"draft config: unknown fields {sorted(unknown)}, missing "
                             f"{sorted(missing)}")
        return cls(**d)


class _RMSNormFunction(torch.autograd.Function):
    """Llama's RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)) with the normalisation in float32,
    with its backward written out so that only x and one float per row are kept (autograd
    would also keep the normalised copy of x: one [T, H] tensor per norm and TTT step, ~7% of
    a step's saved activations; bench/RESULTS.md "Training throughput")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
            grad_w = grad_w.to(weight.dtype)
        # the same roundings as autograd's: the product with weight in its promoted dtype,
        # cast back to x's dtype, then float32 for the normalisation's backward
        d_normed = (grad * weight).to(x.dtype).float()
        dx = rstd * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
        return dx.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


YARN_KEYS = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim")


def yarn_problem(scaling: dict[str, Any], attention: str) -> Optional[str]:
    """Why `scaling` is not a YaRN our layer computes as the engines do, or None. The Llama
    layer's YaRN magnitude is mscale(factor, mscale) / mscale(factor, mscale_all_dim) in vLLM
    only when both are set and non-zero, in SGLang when both are present, else mscale(factor):
    they and we agree when both are set and non-zero or both absent."""
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "yarn" or "factor" not in scaling or \
            "original_max_position_embeddings" not in scaling:
        return "only YaRN with `factor` and `original_max_position_embeddings` is implemented"
    if attention == "mha":
        extra = sorted(set(scaling) - set(YARN_KEYS))
        if extra:
            return f"{extra} not implemented in the Llama layer's YaRN"
        given = [k for k in ("mscale", "mscale_all_dim") if k in scaling]
        if len(given) == 1 or any(not scaling[k] for k in given):
            return ("a Llama layer's YaRN needs mscale and mscale_all_dim both non-zero or both "
                    "absent (vLLM and SGLang differ otherwise)")
    return None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek YaRN's magnitude correction (vLLM's and SGLang's `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict[str, Any]] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Rotary frequencies `[dim // 2]`; with YaRN `scaling`, DeepSeek's blend: frequencies
    whose wavelength fits `original_max_position_embeddings` more than beta_fast times keep
    theta's, those fitting fewer than beta_slow times are divided by `factor`, a linear ramp
    in between (the bounds floored/ceiled, as vLLM's and SGLang's `deepseek_yarn`)."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if not scaling:
        return base
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(float(scaling.get("beta_fast", 32)))), 0)
    high = min(math.ceil(dim_of(float(scaling.get("beta_slow", 1)))), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
            / (high - low)).clamp(0, 1)
    return base / factor * ramp + base * (1 - ramp)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype,
                 scaling: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[..., T, dim]` for integer `positions` `[..., T]` (Llama's half-split
    layout). With YaRN `scaling` the tables carry mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), as the engines' DeepSeek rotary embedding does and, for the scalings
    `yarn_problem` accepts, their Llama one."""
    inv_freq = rope_inv_freq(dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling:
        factor = float(scaling["factor"])
        m = (yarn_mscale(factor, float(scaling.get("mscale", 1)))
             / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0))))
        cos, sin = cos * m, sin * m
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """DeepSeek's rotary embedding, which turns adjacent pairs (x0, x1), (x2, x3), ... (the
    engines' `is_neox_style=False`). Returned with the pairs' members gathered into halves
    (x0, x2, ..., x1, x3, ...), where Llama's half-split rotation does the same turn: the
    permutation is the same for queries and keys, so every score q.k is the engines'."""
    return apply_rope(x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2), cos, sin)


class DocMask:
    """Attention mask of packed rows: a key is visible when it is at or before the query and in
    the same document. Held as document ids, so that `Attention` can run each document's block
    on its own (work and saved activations grow with sum(L_doc^2), not T^2); `dense()` is the
    equivalent `[B, 1, T, T]` bool mask."""

    def __init__(self, doc_ids: torch.Tensor):
        self.doc_ids = doc_ids
        self._spans: Optional[list[tuple[int, int]]] = None
        self._spans_known = False  # computed once per batch (one host sync), then reused
        self._dense: Optional[torch.Tensor] = None

    def spans(self) -> Optional[list[tuple[int, int]]]:
        """(start, end) of each document of a single packed row; None when the row is not one
        contiguous run per document (or B > 1): then the dense mask is used."""
        if not self._spans_known and self.doc_ids.shape[0] == 1:
            ids = self.doc_ids[0]
            cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
            bounds = [0] + cuts + [ids.numel()]
            if len(bounds) - 1 == torch.unique(ids).numel():
                self._spans = list(zip(bounds[:-1], bounds[1:]))
        self._spans_known = True
        return self._spans

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            T = self.doc_ids.shape[-1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.doc_ids.device).tril()
            same = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]
            self._dense = (causal & same)[:, None]
        return self._dense


ATTENTION_BLOCK_ELEMENTS = 1 << 26
"""Score elements per block of `TTTAttention` (query rows x keys x heads x batch): the float32
scores, probabilities and gradients of one block are the attention's only transients, a few
times 256 MB however long the document or many the heads (64 heads x 12k keys: 85 rows)."""


class TTTAttention(torch.autograd.Function):
    """Causal attention over step-0 keys plus each query's own diagonal keys of the later TTT
    steps, with memory linear in L. With `kernel` (`fused_kernel`), the causal block runs in
    the backend's fused flash-attention kernel, whose output and log-sum-exp are merged exactly
    with the diagonal keys. Without it, the same recurrence in plain PyTorch: scores formed one
    block of `chunk` query rows at a time and never saved, recomputed in backward from the saved
    log-sum-exp.

    q, k0, v0 `[B, h, L, d]`; kd, vd `[B, h, L, n, d]` (the n later steps' keys and values at
    the query's own position; n may be 0). Query t sees step-0 keys 0..t and its n diagonal
    keys. Softmax in float32, matmuls in the inputs' dtype, as `Attention._attend` did.
    """

    @staticmethod
    def _scores(q: torch.Tensor, k0: torch.Tensor, kd: torch.Tensor, start: int, end: int,
                scale: float) -> torch.Tensor:
        """Float32 scores of query rows [start, end): [B, h, C, end + n] (keys 0..end-1, then
        the diagonal ones), causally masked."""
        qs = q[:, :, start:end]
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least float32
        s = torch.matmul(qs, k0[:, :, :end].transpose(-1, -2)).to(acc) * scale
        causal = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        s = s.masked_fill(~causal, float("-inf"))
        if kd.shape[3]:
            diag = (qs.unsqueeze(3) * kd[:, :, start:end]).sum(-1).to(acc) * scale
            s = torch.cat([s, diag], dim=-1)
        return s

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: torch.Tensor,
                vd: torch.Tensor, scale: float, chunk: int,
                kernel: Optional["_FlashKernel"] = None) -> torch.Tensor:
        ctx.scale, ctx.chunk, ctx.kernel = scale, chunk, kernel
        if kernel is not None:
            out, lse = _merge_diagonal(q, kd, vd, *kernel.forward(q, k0, v0, scale), scale)
            ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
            return out
        L = q.shape[2]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32),
                          device=q.device)
        for start in range(0, L, chunk):
            end = min(start + chunk, L)
            s = TTTAttention._scores(q, k0, kd, start, end, scale)
            lse[:, :, start:end] = torch.logsumexp(s, dim=-1)
            probs = torch.exp(s - lse[:, :, start:end, None]).to(q.dtype)
            o = torch.matmul(probs[..., :end], v0[:, :, :end])
            if kd.shape[3]:
                o = o + (probs[..., end:, None] * vd[:, :, start:end]).sum(3)
            out[:, :, start:end] = o
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k0, v0, kd, vd, out, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        if ctx.kernel is not None:
            # The kernel's backward, given the merged output and log-sum-exp, yields exactly the
            # causal block's share (its P is normalised by the merged lse, and its row term
            # dout . out is the merged one): the diagonal keys' share is added by hand.
            dq, dk0, dv0 = ctx.kernel.backward(dout, q, k0, v0, out, lse, scale)
            dq, dkd, dvd = _diagonal_backward(dout, q, kd, vd, out, lse, scale, dq)
            return dq, dk0, dv0, dkd, dvd, None, None, None
        L = q.shape[2]
        dq, dk0, dv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        dkd, dvd = torch.zeros_like(kd), torch.zeros_like(vd)
        # D_t = sum_j P_tj dP_tj = dout_t . out_t (the softmax backward's row term)
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        for start in range(0, L, chunk):
            end = min(start + chunk, L)
            s = TTTAttention._scores(q, k0, kd, start, end, scale)
            probs = torch.exp(s - lse[:, :, start:end, None])
            p0 = probs[..., :end].to(q.dtype)
            g = dout[:, :, start:end]
            dv0[:, :, :end] += torch.matmul(p0.transpose(-1, -2), g)
            dp = torch.matmul(g, v0[:, :, :end].transpose(-1, -2)).to(lse.dtype)
            ds = probs[..., :end] * (dp - delta[:, :, start:end, None])
            ds_c = ds.to(q.dtype)
            dq[:, :, start:end] = torch.matmul(ds_c, k0[:, :, :end]) * scale
            dk0[:, :, :end] += torch.matmul(ds_c.transpose(-1, -2), q[:, :, start:end]) * scale
            if kd.shape[3]:
                pd = probs[..., end:]                                        # [B, h, C, n]
                dvd[:, :, start:end] = pd.to(q.dtype)[..., None] * g.unsqueeze(3)
                dpd = (g.unsqueeze(3) * vd[:, :, start:end]).sum(-1).to(lse.dtype)
                dsd = (pd * (dpd - delta[:, :, start:end, None])).to(q.dtype)
                dq[:, :, start:end] += (dsd[..., None] * kd[:, :, start:end]).sum(3) * scale
                dkd[:, :, start:end] = dsd[..., None] * q[:, :, start:end].unsqueeze(3) * scale
        return dq, dk0, dv0, dkd, dvd, None, None, None


def _merge_diagonal(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal block's (output, log-sum-exp) merged exactly with the n diagonal keys:
    softmax over the union = the block's output weighted by exp(lse_block - lse) plus each
    diagonal value weighted by exp(s_j - lse). Float32 weights, output in q's dtype."""
    acc = torch.promote_types(q.dtype, torch.float32)
    block_lse = block_lse.to(acc)
    if not kd.shape[3]:
        return block_out.to(q.dtype), block_lse
    sd = (q.unsqueeze(3) * kd).sum(-1).to(acc) * scale                     # [B, h, L, n]
    lse = torch.logsumexp(torch.cat([block_lse.unsqueeze(-1), sd], dim=-1), dim=-1)
    out = torch.exp(block_lse - lse).unsqueeze(-1) * block_out.to(acc)
    out = out + (torch.exp(sd - lse.unsqueeze(-1)).unsqueeze(-1) * vd.to(acc)).sum(3)
    return out.to(q.dtype), lse


def _diagonal_backward(dout: torch.Tensor, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, scale: float, dq: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq with the diagonal keys' share added, dkd, dvd): O(L n d), no L^2 term."""
    if not kd.shape[3]:
        return dq, torch.zeros_like(kd), torch.zeros_like(vd)
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)              # [B, h, L, 1]
    pd = torch.exp((q.unsqueeze(3) * kd).sum(-1).to(acc) * scale - lse.unsqueeze(-1))
    g = dout.unsqueeze(3)
    dvd = (pd.unsqueeze(-1) * g.to(acc)).to(vd.dtype)
    dsd = pd * ((g * vd).sum(-1).to(acc) - delta)                           # [B, h, L, n]
    dq = dq + ((dsd.unsqueeze(-1) * kd.to(acc)).sum(3) * scale).to(dq.dtype)
    dkd = (dsd.unsqueeze(-1) * q.unsqueeze(3).to(acc) * scale).to(kd.dtype)
    return dq, dkd, dvd


class _FlashKernel:
    """The backend's fused causal attention that returns its log-sum-exp and takes it back in
    backward (PyTorch's flash-attention ops: the CPU kernel, or FlashAttention-2 on CUDA): the
    scores never leave the kernel's tiles, and it runs about 10x faster than the plain
    recurrence on a CPU (bench/RESULTS.md, "Fused attention")."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cuda:
            r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                    scale=scale)
            self._meta = r[2:8]  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed and offset
            return r[0], r[1]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dout = dout.contiguous()
        if self.cuda:
            cq, ck, mq, mk, seed, offset = self._meta
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale)


_KERNEL_CHECKED: dict[tuple[str, torch.dtype, int], bool] = {}


def fused_kernel(q: torch.Tensor) -> Optional[_FlashKernel]:
    """The fused kernel for q's device, dtype and head size, once it has matched the plain
    recurrence (forward and every gradient) on a small problem in this process; else None,
    with one warning: an engine build without the op, a dtype or head size it refuses, or a
    result that differs runs the plain recurrence, which is exact everywhere."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _KERNEL_CHECKED:
        # In a thread of its own: saved-tensor hooks and autocast are per thread, so the check's
        # own autograd is invisible to an activation checkpoint around the first call (whose
        # recomputation must save exactly what the first forward saved).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _KERNEL_CHECKED[key] = pool.submit(
                _kernel_agrees, _FlashKernel(q.device.type), q.detach()).result()
    return _FlashKernel(q.device.type) if _KERNEL_CHECKED[key] else None


def _kernel_agrees(kernel: _FlashKernel, like: torch.Tensor) -> bool:
    import logging
    gen = torch.Generator(device=like.device).manual_seed(0)
    shapes = [(1, 2, 37, like.shape[-1])] * 3 + [(1, 2, 37, 2, like.shape[-1])] * 2
    ref_dtype = torch.promote_types(like.dtype, torch.float32)
    xs = [torch.randn(s, generator=gen, device=like.device, dtype=ref_dtype) for s in shapes]
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(like.dtype, 5e-2)
    try:
        with torch.enable_grad():
            got, want = ([x.to(like.dtype).requires_grad_() for x in xs],
                         [x.clone().requires_grad_() for x in xs])
            scale = like.shape[-1] ** -0.5
            out = TTTAttention.apply(*got, scale, 16, kernel)
            ref = TTTAttention.apply(*want, scale, 16, None)
            grad = torch.randn(out.shape, generator=gen, device=like.device, dtype=ref_dtype)
            g_got = torch.autograd.grad(out, got, grad.to(like.dtype))
            g_want = torch.autograd.grad(ref, want, grad)
        worst = max((a.to(ref_dtype) - b).abs().max().item() / (1 + b.abs().max().item())
                    for a, b in zip([out, *g_got], [ref, *g_want]))
        ok, why = worst <= tol, f"differs from the plain recurrence by {worst:.2g}"
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        ok, why = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    if not ok:
        logging.getLogger("eagle3").warning(
            "fused attention kernel not used on %s %s (head size %d): %s; attention runs the "
            "plain recurrence (exact, slower)", like.device.type, like.dtype, like.shape[-1], why)
    return ok


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  later: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                  chunk: Optional[int] = None) -> torch.Tensor:
    """`TTTAttention` over step-0 keys/values and the later steps' (k, v) `[B, h, L, d]`, in
    blocks of `chunk` query rows (default: `ATTENTION_BLOCK_ELEMENTS` scores per block)."""
    B, h, L, d = q.shape
    chunk = chunk or max(16, ATTENTION_BLOCK_ELEMENTS // (B * h * L))
    if later:
        kd = torch.stack([k for k, _ in later], dim=3)
        vd = torch.stack([v for _, v in later], dim=3)
    else:
        kd = vd = q.new_zeros(B, h, L, 0, d)
    return TTTAttention.apply(q, k0, v0, kd, vd, scale, chunk, fused_kernel(q))


class DecodeCache:
    """One layer's keys and values for decoding one sequence incrementally, as an engine keeps
    them (the reference decoder): the step-0 keys of every position drafted from the
    verifier's own states, kept from round to round like a KV cache, and the last position's
    keys of the current draft chain's later steps, dropped when the next round adds positions.
    A query sees what the same query of the training forward sees (`_DiagonalAttention`): the
    step-0 keys at or before it and its own position's later-step keys, so decoding the last
    position costs one row where the training forward would recompute the whole sequence."""

    def __init__(self) -> None:
        self.k0: Optional[torch.Tensor] = None
        self.v0: Optional[torch.Tensor] = None
        self.chain: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None

    @property
    def length(self) -> int:
        """Positions whose step-0 keys are held."""
        return 0 if self.k0 is None else self.k0.shape[2]

    def extend(self) -> None:
        """The next step adds positions (step 0 from their verifier states)."""
        self.chain = None

    def draft(self) -> None:
        """The next steps are the last position's later steps (a new chain)."""
        self.chain = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """Attention output `[B, heads, T, d]` of the step's queries, after storing its keys."""
        if self.chain is None:
            self.k0 = k if self.k0 is None else torch.cat([self.k0, k], dim=2)
            self.v0 = v if self.v0 is None else torch.cat([self.v0, v], dim=2)
            keys, values = self.k0, self.v0
            P, T = keys.shape[2], q.shape[2]
            positions = torch.arange(P, device=q.device)
            visible = positions[None] <= positions[P - T:, None]          # [T, P] causal
        else:
            if q.shape[2] != 1:
                raise ValueError("a draft chain step decodes the last position only")
            self.chain.append((k, v))
            keys = torch.cat([self.k0, *(kj for kj, _ in self.chain)], dim=2)
            values = torch.cat([self.v0, *(vj for _, vj in self.chain)], dim=2)
            visible = None
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)


class _DiagonalAttention(nn.Module):
    """Attention that also attends to the same position's earlier TTT steps; subclasses make
    the queries, keys and values (`qkv`) and own `o_proj`.

    Step k's query at position t sees the step-0 keys allowed by `mask` (causal, same document)
    plus the keys of steps 1..k at position t itself ("diagonal" keys). Scores are [L, L + k]
    per head and document (L its length): the (steps*T)^2 mask of a naive implementation is
    never built, and neither are the cross-document blocks of a packed row.
    """
    n_heads: int
    out_dim: int
    """Per-head width of the values the output projection reads."""
    scale: float

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[B, heads, T, d]`, one width d for all three (zero-padded where needed).
        Abstract: `Attention` and `MLAttention` define it."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[DocMask | torch.Tensor],
                cache: list[tuple[torch.Tensor, torch.Tensor]] | DecodeCache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if isinstance(cache, DecodeCache):
            out = cache.attend(q, k, v, self.scale)
        else:
            cache.append((k, v))
            spans = mask.spans() if isinstance(mask, DocMask) else None
            if spans is None:
                dense = mask.dense() if isinstance(mask, DocMask) else mask
                out = self._attend(q, cache, 0, T, dense)
            elif len(spans) == 1:
                out = self._attend(q, cache, 0, T, None)
            else:
                out = torch.cat([self._attend(q, cache, s, e, None) for s, e in spans], dim=2)
        out = out[..., :self.out_dim].transpose(1, 2).reshape(B, T, self.n_heads * self.out_dim)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                start: int, end: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention output of queries [start, end) over step-0 keys [start, end) (causal, or
        `mask` when given) and their own diagonal keys of the later cached steps. The causal
        case runs `ttt_attention` (memory linear in L); a dense mask (rows that are not one
        run per document) forms the [L, L + k] scores."""
        L = end - start
        scale = self.scale
        qs = q[:, :, start:end]
        k0, v0 = cache[0][0][:, :, start:end], cache[0][1][:, :, start:end]
        if mask is None:  # one causal document: memory linear in L
            return ttt_attention(qs, k0, v0, [(k[:, :, start:end], v[:, :, start:end])
                                              for k, v in cache[1:]], scale)
        scores = torch.matmul(qs, k0.transpose(-1, -2)) * scale          # [B, h, L, L]
        scores = scores.masked_fill(~mask, float("-inf"))
        if len(cache) > 1:
            diag = torch.stack([(qs * kj[:, :, start:end]).sum(-1) for kj, _ in cache[1:]],
                               dim=-1) * scale
            scores = torch.cat([scores, diag], dim=-1)                     # [B, h, L, L + k]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs[..., :L], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + probs[..., L + j, None] * vj[:, :, start:end]
        return out


class Attention(_DiagonalAttention):
    """Llama attention (grouped keys and values, half-split RoPE over the whole head)."""

    def __init__(self, cfg: DraftModelConfig, input_size: int):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = self.out_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(input_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class MLAttention(_DiagonalAttention):
    """DeepSeek-V2/V3 multi-head latent attention, the layer of lightseek's Kimi drafters
    (`Eagle3DeepseekV2ForCausalLM`; names and math as vLLM's and SGLang's
    `DeepseekV2*Attention*`, docs/engines.md "MLA draft layer"):

        q = q_b_proj(q_a_layernorm(q_a_proj(x)))            [heads, nope + rope]
        latent, k_rope = kv_a_proj_with_mqa(x)              [kv_lora], [rope] (one for all heads)
        k_nope, v = kv_b_proj(kv_a_layernorm(latent))       [heads, nope], [heads, v]
        k = cat(k_nope, rope(k_rope)); q = cat(q_nope, rope(q_rope))

    Trained in this expanded form (each head's key and value), the same TTT attention as the
    Llama layer; the engines serve it from the latent. Queries, keys and values are zero-padded
    to one width (max(nope + rope, v)), which changes no score and no output.
    """

    def __init__(self, cfg: DraftModelConfig, input_size: int):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.out_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                              cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.width = max(qk, self.out_dim)
        self.scale = qk ** -0.5
        if cfg.rope_scaling:  # YaRN sharpens the softmax by mscale(factor, mscale_all_dim)^2
            self.scale *= yarn_mscale(float(cfg.rope_scaling["factor"]),
                                      float(cfg.rope_scaling.get("mscale_all_dim", 0))) ** 2
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(input_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(input_size, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.out_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.out_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        h = self.n_heads
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj")
             else self.q_proj(x))
        q_nope, q_rope = q.view(B, T, h, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.out_dim], -1)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(k_rope.unsqueeze(1), cos, sin).expand(B, h, T, self.rope)
        q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
        pad_qk, pad_v = self.width - q.shape[-1], self.width - self.out_dim
        return (F.pad(q, (0, pad_qk)) if pad_qk else q, F.pad(k, (0, pad_qk)) if pad_qk else k,
                F.pad(v, (0, pad_v)) if pad_v else v)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward (autograd also keeps silu(gate):
    one [T, intermediate] tensor per TTT step)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        d_up = grad * (gate * sig)
        d_gate = (grad * up) * sig * (1 + gate * (1 - sig))  # silu'(x) = s (1 + x (1 - s))
        return d_gate, d_up


class MLP(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Layer 0 takes cat(embedding, hidden) (2H wide); later layers are plain Llama layers."""

    def __init__(self, cfg: DraftModelConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        attention = MLAttention if cfg.attention == "mla" else Attention
        self.self_attn = attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, embeds: Optional[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: Optional[DocMask | torch.Tensor],
                cache: list[tuple[torch.Tensor, torch.Tensor]] | DecodeCache) -> torch.Tensor:
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = h
            x = self.input_layernorm(h)
        h = residual + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # EAGLE-3.1 (docs/engines.md "EAGLE-3.1 norms"): vLLM, SGLang and speculators name
        # these `fc_norm.<i>` and apply them to the aux chunks in layer order
        self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                     for _ in range(cfg.num_aux)) if cfg.fc_norm else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, first=(i == 0))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # A full-vocabulary head has the identity map by construction and none in its state
        # dict, so no checkpoint or export of it carries one.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                             persistent=not cfg.full_vocab)
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), cfg.full_vocab),
                             persistent=not cfg.full_vocab)

    def new_cache(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per-layer key/value lists: entry j holds TTT step j's keys and values."""
        return [[] for _ in self.layers]

    def new_decode_cache(self) -> list[DecodeCache]:
        """Per-layer caches for decoding one sequence incrementally (`DecodeCache`)."""
        return [DecodeCache() for _ in self.layers]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Verifier aux states `[B, T, n_aux*Ht]` -> initial draft hidden state `[B, T, H]`."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in
                             zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def step(self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
             mask: Optional[DocMask | torch.Tensor],
             cache: list[list[tuple[torch.Tensor, torch.Tensor]]] | list[DecodeCache]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: returns (the hidden state the next step reads, draft-vocab logits).
        That state is the layer's pre-norm output, or with `norm_output` (EAGLE-3.1) the
        post-norm one that `lm_head` reads.

        h `[B, T, H]`, input_ids `[B, T]` (the token after each aux position, shifted by the
        step), positions `[B, T]` (RoPE positions, + step), mask over step-0 keys: a `DocMask`
        (`causal_doc_mask`) or a `[B or 1, 1, T, T]` bool tensor. `cache` carries earlier
        steps' keys; call with a fresh one at step 0. With `new_decode_cache()` (decoding one
        sequence, B = 1) the positions are new ones or the last one's later step, as the cache
        says (`DecodeCache`), and `mask` is None.
        """
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        cos, sin = rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta, h.dtype,
                                self.cfg.rope_scaling)
        cos, sin = cos[:, None], sin[:, None]
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, embeds, cos, sin, mask, layer_cache)
            embeds = None
        if self.cfg.norm_output:
            # back to the state's dtype: under bf16 autocast the fp32 norm weight promotes its
            # output, and the next step's rope and keys would then be fp32 beside bf16 ones
            h = self.norm(h).to(h.dtype)
            return h, self.lm_head(h)
        return h, self.lm_head(self.norm(h))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint ships: all weights but the (frozen, verifier-owned) embedding,
        plus the d2t/t2d vocabulary maps of a reduced draft vocabulary."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def causal_doc_mask(doc_ids: torch.Tensor) -> DocMask:
    """`[B, T]` document ids -> the mask "key <= query within the same document" (`DocMask`;
    `.dense()` is the `[B, 1, T, T]` bool tensor)."""
    return DocMask(doc_ids)
