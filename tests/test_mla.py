"""The MLA draft layer (`draft.attention: mla`) against transformers' DeepSeek-V3 attention at
equal weights, and its training-time-test attention against the written-out definition."""

import math

import pytest
import torch

from eagle3.model import (DraftModelConfig, Eagle3DraftModel, MLAttention, causal_doc_mask,
                          rope_cos_sin)

KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
REHEARSAL_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_config(q_lora_rank=24, rope_scaling=None, hidden=48, **over) -> DraftModelConfig:
    fields = dict(hidden_size=hidden, target_hidden_size=hidden, num_aux=3,
                  intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                  head_dim=24, num_layers=1, rms_norm_eps=1e-6, rope_theta=50000.0,
                  max_position_embeddings=8192, vocab_size=96, draft_vocab_size=96,
                  attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  rope_scaling=rope_scaling)
    return DraftModelConfig(**{**fields, **over})


def transformers_attention(cfg: DraftModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**{k: v for k, v in cfg.rope_scaling.items() if k != "type"},
                "rope_type": "yarn", "rope_theta": cfg.rope_theta}
    hf = DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope, attention_bias=False, rope_interleave=True)
    hf._attn_implementation = "eager"
    return DeepseekV3Attention(hf, layer_idx=0), DeepseekV3RotaryEmbedding(hf)


def max_difference(ours, theirs, rotary, cfg: DraftModelConfig, T: int, start: int) -> float:
    """Largest difference between our attention and transformers' at equal weights on a causal
    batch of 2 x T tokens at positions start.."""
    B = 2
    positions = (torch.arange(T) + start).expand(B, T)
    x = torch.randn(B, T, cfg.hidden_size)
    causal = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)
    want = theirs(x, rotary(x, positions), causal)[0]
    cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
    got = ours(x, cos[:, None], sin[:, None], causal_doc_mask(torch.zeros(B, T, dtype=torch.long)),
               [])
    return (got - want).abs().max().item()


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("rope_scaling", [None, KIMI_YARN, REHEARSAL_YARN],
                         ids=["plain", "kimi-yarn", "rehearsal-yarn"])
def test_mla_forward_equals_transformers_deepseek_v3_attention(q_lora_rank, rope_scaling):
    """Step 0 of our MLA layer is transformers' DeepseekV3Attention at equal weights (same
    parameter names), in float32, to 1e-5: projections, latent norms, interleaved rotary
    embedding, YaRN frequencies and softmax scale."""
    cfg = mla_config(q_lora_rank, rope_scaling)
    theirs, rotary = transformers_attention(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ours = MLAttention(cfg, cfg.hidden_size)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    # past YaRN's original length: all frequencies matter
    assert max_difference(ours, theirs, rotary, cfg, 37, 3000 if rope_scaling else 0) <= 1e-5


def test_mla_ttt_attention_matches_the_written_out_definition():
    """Later TTT steps see step 0's keys causally plus their own position's earlier-step keys,
    with MLA's scale and value width, exactly as the naive (steps*T)^2-masked attention."""
    cfg = mla_config(rope_scaling=REHEARSAL_YARN)
    torch.manual_seed(1)
    attn = MLAttention(cfg, cfg.hidden_size).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    T, steps = 11, 3
    xs = [torch.randn(1, T, cfg.hidden_size, dtype=torch.float64) for _ in range(steps)]
    cache, keys, values = [], [], []
    mask = causal_doc_mask(torch.zeros(1, T, dtype=torch.long))
    for k, x in enumerate(xs):
        pos = (torch.arange(T) + k)[None]
        cos, sin = rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling)
        got = attn(x, cos[:, None], sin[:, None], mask, cache)
        q, kk, v = attn.qkv(x, cos[:, None], sin[:, None])
        keys.append(kk[0])
        values.append(v[0, :, :, :cfg.v_head_dim])
        K, V = torch.cat(keys, 1), torch.cat(values, 1)
        allowed = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
        for t in range(T):
            allowed[t, :t + 1] = True
            for j in range(1, k + 1):
                allowed[t, j * T + t] = True
        s = (q[0] @ K.transpose(-1, -2) * attn.scale).masked_fill(~allowed, float("-inf"))
        o = torch.softmax(s, -1) @ V
        want = attn.o_proj(o.transpose(0, 1).reshape(T, -1))
        assert torch.allclose(got[0], want, atol=1e-10)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert attn.scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / math.sqrt(qk))


def test_mla_drafter_keys_are_the_engines_names():
    """The parameter names of an MLA drafter are those vLLM's and SGLang's
    Eagle3DeepseekV2ForCausalLM loaders read (docs/engines.md "MLA draft layer")."""
    with torch.device("meta"):
        model = Eagle3DraftModel(mla_config(hidden=16))
    attn = sorted(k for k in model.trainable_state_dict() if ".self_attn." in k)
    assert attn == [f"layers.0.self_attn.{n}.weight" for n in (
        "kv_a_layernorm", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_layernorm",
        "q_a_proj", "q_b_proj")]
    assert tuple(model.layers[0].self_attn.q_a_proj.weight.shape) == (24, 32)  # 2H input


# ---------------------------------------------------------------------------------------------
# YaRN on the Llama layer (a base such as lightseekorg's kimi-k2.5-eagle3)


@pytest.mark.parametrize("scaling", [
    {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # Kimi's
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},   # plain YaRN
], ids=["kimi", "plain"])
def test_llama_layer_yarn_equals_transformers_llama_attention(scaling):
    """The Llama layer with YaRN is transformers' LlamaAttention with the same rope parameters
    at equal weights (frequencies, magnitude, softmax scale untouched), past the original
    context, to 1e-5 in float32."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from eagle3.model import Attention
    cfg = DraftModelConfig(hidden_size=48, target_hidden_size=48, num_aux=3,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_layers=1, rms_norm_eps=1e-6, rope_theta=50000.0,
                           max_position_embeddings=262144, vocab_size=96, draft_vocab_size=96,
                           rope_scaling=scaling)
    hf = LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=262144, attention_bias=False,
                     rope_parameters={**{k: v for k, v in scaling.items() if k != "type"},
                                      "rope_type": "yarn", "rope_theta": 50000.0})
    hf._attn_implementation = "eager"
    theirs, rotary = LlamaAttention(hf, layer_idx=0), LlamaRotaryEmbedding(hf)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    ours = Attention(cfg, cfg.hidden_size)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert max_difference(ours, theirs, rotary, cfg, 29, 5000) <= 1e-5
    assert ours.scale == 16 ** -0.5


@pytest.mark.parametrize("scaling,problem", [
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 0.7},
     "both non-zero or both absent"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
      "attention_factor": 1.2}, "not implemented in the Llama layer"),
    ({"type": "linear", "factor": 4.0}, "only YaRN"),
])
def test_llama_layer_yarn_the_engines_disagree_on_is_refused(scaling, problem):
    with pytest.raises(ValueError, match=problem):
        DraftModelConfig(hidden_size=48, target_hidden_size=48, num_aux=3, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_layers=1,
                         rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=8192,
                         vocab_size=96, draft_vocab_size=96, rope_scaling=scaling)
