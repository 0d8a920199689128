"""Fine-tuning from a base drafter: layouts, exact logits, and one clear error per bad base.

    .venv/bin/pytest tests/test_finetune.py -q

A random drafter is written with `formats.write_export` in each layout (SGLang `midlayer.*`,
speculators, vLLM), read back with `load_base_drafter`, checked with `check_base`, loaded into a
fresh `Eagle3DraftModel`, and must give bit-identical logits. Each corruption of a base must be
reported by name.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.base_drafter import (BaseDrafterError, base_state_dict, check_base,
                                 finetune_draft_config)
from eagle3.base_drafter import load as load_base_drafter
from eagle3.base_drafter import load_vocab as load_base_vocab
from eagle3.formats import ExportContext, write_export
from eagle3.model import DraftModelConfig, Eagle3DraftModel, causal_doc_mask
from eagle3.vocab import remap_lm_head
from eagle3.weights_io import load as load_tensor
from test_formats import rewrite

_V, _VD, _H = 120, 40, 32
_AUX = [2, 4, 6]

DRAFT = DraftModelConfig(hidden_size=_H, target_hidden_size=_H, num_aux=3, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_layers=1,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                         vocab_size=_V, draft_vocab_size=_VD)


def random_model(cfg: DraftModelConfig = DRAFT, seed: int = 0) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    m = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        targets = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
        m.d2t.copy_(targets - torch.arange(cfg.draft_vocab_size))
        m.t2d.zero_()
        m.t2d[targets] = True
    return m


def write_base(tmp_path: Path, fmt: str, model: Eagle3DraftModel, name: str = "base") -> Path:
    out = tmp_path / name
    out.mkdir()
    write_export(out, fmt, model.trainable_state_dict(), model.cfg, _AUX,
                 ExportContext("/verifiers/tiny", "LlamaForCausalLM"))
    return out


def edit(out: Path, tensors=None, config=None) -> None:
    rewrite(out, edit_tensors=tensors, edit_config=config)


def logits_of(model: Eagle3DraftModel, steps: int = 3) -> list[torch.Tensor]:
    """Per-step logits of a fixed packed batch of two documents."""
    gen = torch.Generator().manual_seed(7)
    T = 14
    aux = torch.randn(1, T, model.cfg.num_aux * model.cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen)
    doc = torch.tensor([[0] * 6 + [1] * 8])
    pos = torch.tensor([list(range(6)) + list(range(8))])
    mask, cache = causal_doc_mask(doc), model.new_cache()
    h, out = model.project(aux), []
    with torch.no_grad():
        for k in range(steps):
            h, logits = model.step(h, ids.roll(-k, 1), pos + k, mask, cache)
            out.append(logits)
    return out


def finetuned(base_dir: Path, cfg: DraftModelConfig, embed: torch.Tensor) -> Eagle3DraftModel:
    """What stage 04 does with --finetune-from: load, check, build, load weights."""
    base = load_base_drafter(base_dir)
    cfg = finetune_draft_config(cfg, base)
    check_base(base, cfg, embed, base.d2t, base.t2d)
    model = Eagle3DraftModel(cfg)
    model.load_state_dict(base_state_dict(base, embed))
    return model


def problems(base_dir: Path, cfg: DraftModelConfig = DRAFT, embed=None, **kw) -> list[str]:
    base = load_base_drafter(base_dir)
    ref = random_model(cfg)
    with pytest.raises(BaseDrafterError) as e:
        check_base(base, finetune_draft_config(cfg, base),
                   ref.embed_tokens.weight if embed is None else embed, **kw)
    return e.value.problems


# ---------------------------------------------------------------------------------------------
# Every layout reproduces the base exactly


@pytest.mark.parametrize("fmt,nbr,layers,eagle31", [
    ("sglang", False, 1, False), ("speculators", False, 1, False),
    ("speculators", True, 2, False), ("vllm", False, 1, False),
    ("sglang", False, 1, True), ("speculators", False, 1, True), ("vllm", False, 1, True)])
def test_finetune_reproduces_base_logits(tmp_path, fmt, nbr, layers, eagle31):
    """Each layout, with and without EAGLE-3.1's norms (`fc_norm.<i>`, `norm_output`)."""
    cfg = dataclasses.replace(DRAFT, norm_before_residual=nbr, num_layers=layers,
                              fc_norm=eagle31, norm_output=eagle31)
    ref = random_model(cfg)
    base_dir = write_base(tmp_path, fmt, ref)
    base = load_base_drafter(base_dir)
    assert base.layout == fmt
    assert base.shape.norm_before_residual is nbr and base.shape.num_layers == layers
    assert base.shape == cfg
    model = finetuned(base_dir, cfg, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)


def test_base_hparams_win_over_verifier_derived(tmp_path):
    """Heads, head_dim, MLP width, RoPE theta and eps come from the base (its weights were
    trained with them; ours are only derived from the verifier)."""
    ref = random_model(dataclasses.replace(DRAFT, rope_theta=500000.0, rms_norm_eps=1e-5,
                                           num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, intermediate_size=48))
    base_dir = write_base(tmp_path, "sglang", ref)
    edit(base_dir, config=lambda c: c.pop("head_dim"))  # read off q_proj instead
    model = finetuned(base_dir, DRAFT, ref.embed_tokens.weight)
    assert model.cfg == ref.cfg
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    # checked without adopting them, the mismatch is named
    base = load_base_drafter(base_dir)
    with pytest.raises(BaseDrafterError, match="rope_theta=500000.0"):
        check_base(base, DRAFT, ref.embed_tokens.weight)


def test_sharded_index_loading(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    tensors = load_file(str(base_dir / "model.safetensors"))
    (base_dir / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(base_dir / name))
        weight_map.update({k: name for k in ks})
    (base_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = finetuned(base_dir, DRAFT, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    d2t, t2d = load_base_vocab(base_dir)
    assert torch.equal(d2t, ref.d2t) and torch.equal(t2d, ref.t2d)


def test_pytorch_bin_with_compile_prefix(tmp_path):
    """EAGLE-official style: pytorch_model.bin, here also saved from a torch.compile'd model."""
    ref = random_model()
    base_dir = write_base(tmp_path, "sglang", ref)
    tensors = load_file(str(base_dir / "model.safetensors"))
    (base_dir / "model.safetensors").unlink()
    torch.save({f"_orig_mod.{k}": v for k, v in tensors.items()},
               base_dir / "pytorch_model.bin")
    model = finetuned(base_dir, DRAFT, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)


def test_config_defaults_and_aux_ids(tmp_path):
    ref = random_model()
    spec = write_base(tmp_path, "speculators", ref, "spec")
    edit(spec, config=lambda c: c.pop("norm_before_residual"))
    assert load_base_drafter(spec).shape.norm_before_residual is True  # speculators' default
    assert load_base_drafter(spec).aux_layer_ids == _AUX
    sgl = write_base(tmp_path, "sglang", ref, "sgl")
    edit(sgl, config=lambda c: c.pop("norm_before_residual"))
    base = load_base_drafter(sgl)
    assert base.shape.norm_before_residual is False
    # Our SGLang export writes ids valid on every SGLang version: [1,3,5] for [2,4,6].
    assert base.aux_layer_ids == [1, 3, 5]
    for arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM"):
        for version in ("post-25454", "pre-25454"):
            assert base.aux_ids_internal(arch, version) == _AUX
    # AQ-MedAI writes [2,30,58]-style ids: their meaning depends on the target model and on
    # the SGLang version.
    edit(sgl, config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=_AUX))
    kimi = "KimiK25ForConditionalGeneration"
    assert load_base_drafter(sgl).aux_ids_internal(kimi, "post-25454") == _AUX
    assert load_base_drafter(sgl).aux_ids_internal(kimi, "pre-25454") == [3, 5, 7]
    assert load_base_drafter(sgl).aux_ids_internal("LlamaForCausalLM") == [3, 5, 7]


def test_embedding_equal_to_verifier_is_accepted(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    edit(base_dir, tensors=lambda t: t.update({"embed_tokens.weight":
                                               ref.embed_tokens.weight.detach().clone()}))
    model = finetuned(base_dir, DRAFT, ref.embed_tokens.weight)
    assert torch.equal(model.embed_tokens.weight, ref.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------
# Each bad base fails with its own message


def test_wrong_shape(tmp_path):
    base_dir = write_base(tmp_path, "sglang", random_model())
    edit(base_dir, tensors=lambda t: t.update({"midlayer.mlp.up_proj.weight": torch.zeros(48, 32)}))
    (msg,) = problems(base_dir)
    assert msg == ("`midlayer.mlp.up_proj.weight` has shape [48, 32], our drafter expects "
                   "[64, 32]")


def test_missing_key(tmp_path):
    base_dir = write_base(tmp_path, "sglang", random_model())
    edit(base_dir, tensors=lambda t: t.pop("midlayer.hidden_norm.weight"))
    (msg,) = problems(base_dir)
    assert msg == "missing tensor `midlayer.hidden_norm.weight` (expected shape [32])"


def test_extra_key(tmp_path):
    base_dir = write_base(tmp_path, "speculators", random_model())
    edit(base_dir, tensors=lambda t: t.update({"input_norm.weight": torch.ones(96)}))
    (msg,) = problems(base_dir)
    assert msg.startswith("unexpected tensor `input_norm.weight` [96]")


def test_different_vocab_map(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    other = random_model(seed=1)
    (msg,) = problems(base_dir, d2t=other.d2t, t2d=other.t2d)
    assert msg.startswith("vocabulary map differs from 03_vocab's")
    assert "vocab.from_checkpoint=true" in msg and "vocab.allow_remap=true" in msg
    # explicitly allowed, even with another draft size, it is not an error
    base = load_base_drafter(base_dir)
    small = dataclasses.replace(DRAFT, draft_vocab_size=24)
    check_base(base, small, ref.embed_tokens.weight, other.d2t[:24], other.t2d,
               allow_remap=True)


def test_wrong_embedding(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    edit(base_dir, tensors=lambda t: t.update({"embed_tokens.weight": torch.randn(_V, _H)}))
    (msg,) = problems(base_dir, embed=ref.embed_tokens.weight)
    assert msg.startswith("`embed_tokens.weight` differs from the verifier's embedding")


def test_unsupported_flag_and_norm_placement(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    edit(base_dir, config=lambda c: c.update(norm_before_fc=True, norm_before_residual=True))
    msgs = problems(base_dir)
    assert len(msgs) == 2
    assert msgs[0].startswith("config: `norm_before_fc` is true")
    assert "set draft.norm_before_residual=true" in msgs[1]


def test_yarn_the_engines_read_differently_is_named(tmp_path):
    """A Llama-layer base whose YaRN we would not compute as the engines do is refused by name:
    `attention_factor` (not implemented), or `mscale` without `mscale_all_dim` (vLLM and SGLang
    disagree)."""
    from test_convert import aq_medai_dir
    ref = random_model()
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    base_dir = aq_medai_dir(tmp_path / "a", ref, rope_scaling={**yarn, "attention_factor": 1.1})
    assert any("attention_factor" in p for p in problems(base_dir))
    base_dir = aq_medai_dir(tmp_path / "b", ref, rope_scaling={**yarn, "mscale": 0.7})
    with pytest.raises(BaseDrafterError, match="both non-zero or both absent"):
        load_base_drafter(base_dir)


def test_eagle31_base_needs_the_same_norms_and_legacy_names_read(tmp_path):
    """A base trained with EAGLE-3.1's norms: our drafter must have them too (one line naming
    the setting); an older SGLang-trained one (`aux_norm_low/mid/high`, `use_aux_norm`) is read
    as `fc_norm.0/1/2` and reproduces its logits."""
    cfg = dataclasses.replace(DRAFT, fc_norm=True, norm_output=True)
    ref = random_model(cfg)
    base_dir = write_base(tmp_path, "sglang", ref)
    msgs = problems(base_dir, DRAFT)
    assert "config: base has fc_norm=True, our drafter False: set draft.fc_norm=true" in msgs
    assert any("set draft.norm_output=true" in m for m in msgs)
    legacy = dict(zip(("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"),
                      ("aux_norm_low.weight", "aux_norm_mid.weight", "aux_norm_high.weight")))
    edit(base_dir, tensors=lambda t: t.update({legacy[k]: t.pop(k) for k in list(t)
                                               if k in legacy}),
         config=lambda c: (c.pop("fc_norm"), c.update(use_aux_norm=True)))
    assert load_base_drafter(base_dir).shape == cfg
    model = finetuned(base_dir, cfg, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)


def test_every_problem_in_one_error(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "sglang", ref)
    edit(base_dir, tensors=lambda t: (t.pop("fc.weight"), t.update(extra=torch.zeros(1))))
    base = load_base_drafter(base_dir)
    with pytest.raises(BaseDrafterError) as e:
        check_base(base, dataclasses.replace(DRAFT, num_attention_heads=8, head_dim=4,
                                             num_layers=2), ref.embed_tokens.weight)
    msgs = e.value.problems
    assert any("num_attention_heads=4" in m for m in msgs)
    assert any("num_layers=1" in m for m in msgs)
    assert any(m.startswith("missing tensor `fc.weight`") for m in msgs)
    assert any(m.startswith("unexpected tensor `extra`") for m in msgs)


def test_absolute_d2t_in_base_is_named(tmp_path):
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    edit(base_dir, tensors=lambda t: t.update(d2t=t["d2t"] + torch.arange(_VD)))
    msgs = problems(base_dir)
    assert any("absolute target ids" in m for m in msgs)


def test_not_a_drafter(tmp_path):
    with pytest.raises(BaseDrafterError, match="config.json missing"):
        load_base_drafter(tmp_path)


def test_per_document_attention_equals_dense_mask():
    """The packed-row fast path (one block per document) computes what the dense mask does."""
    model = random_model().double()
    gen = torch.Generator().manual_seed(3)
    T = 14
    aux = torch.randn(1, T, 3 * _H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, _V, (1, T), generator=gen)
    doc = torch.tensor([[0] * 6 + [1] * 8])
    pos = torch.tensor([list(range(6)) + list(range(8))])
    fast, dense = causal_doc_mask(doc), causal_doc_mask(doc).dense()
    assert fast.spans() == [(0, 6), (6, 14)]
    outs = []
    for mask in (fast, dense):
        h, cache, logits = model.project(aux), model.new_cache(), []
        for k in range(3):
            h, lg = model.step(h, ids.roll(-k, 1), pos + k, mask, cache)
            logits.append(lg)
        outs.append(logits)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # softmax runs in fp32


# ---------------------------------------------------------------------------------------------
# Vocabulary when fine-tuning


def test_remap_lm_head_moves_rows_by_token():
    H = 4
    verifier = torch.arange(10 * H, dtype=torch.float32).view(10, H) + 1000
    base_targets = torch.tensor([1, 3, 5, 7])
    base_d2t = base_targets - torch.arange(4)
    base_head = torch.randn(4, H)
    new_targets = torch.tensor([0, 3, 7, 8, 9])
    new_d2t = new_targets - torch.arange(5)
    out = remap_lm_head(base_head, base_d2t, new_d2t, verifier)
    assert out.shape == (5, H)
    assert torch.equal(out[1], base_head[1]) and torch.equal(out[2], base_head[3])
    assert torch.equal(out[0], verifier[0])
    assert torch.equal(out[3], verifier[8]) and torch.equal(out[4], verifier[9])


def test_remapped_model_scores_shared_tokens_like_the_base(tmp_path):
    """After a remap, logits of tokens in both maps are unchanged (same rows, same hidden)."""
    ref = random_model()
    base_dir = write_base(tmp_path, "speculators", ref)
    base = load_base_drafter(base_dir)
    other = random_model(seed=1)
    verifier_head = torch.randn(_V, _H)
    head = remap_lm_head(load_tensor(base.weights["lm_head.weight"]), base.d2t, other.d2t, verifier_head)
    check_base(base, DRAFT, ref.embed_tokens.weight, other.d2t, other.t2d, allow_remap=True)
    model = Eagle3DraftModel(DRAFT)
    model.load_state_dict(base_state_dict(base, ref.embed_tokens.weight, other.d2t, other.t2d,
                                          head))
    old_t = (torch.arange(_VD) + ref.d2t).tolist()
    new_t = (torch.arange(_VD) + other.d2t).tolist()
    shared = sorted(set(old_t) & set(new_t))
    assert shared
    a, b = logits_of(ref)[0], logits_of(model)[0]
    for tok in shared:
        assert torch.equal(a[..., old_t.index(tok)], b[..., new_t.index(tok)])


def test_vocab_mode_resolution(tmp_path):
    from eagle3.config import ConfigError, config_from_dict

    def cfg(vocab=None, train=None):
        return config_from_dict({"run": {"name": "t", "dir": str(tmp_path)},
                                 "verifier": {"path": str(tmp_path)},
                                 "vocab": vocab or {}, "train": train or {}})
    assert not cfg().copies_base_vocab
    assert cfg(train={"finetune_from": "/base"}).copies_base_vocab
    assert not cfg({"allow_remap": True}, {"finetune_from": "/base"}).copies_base_vocab
    assert not cfg({"from_checkpoint": False}, {"finetune_from": "/base"}).copies_base_vocab
    with pytest.raises(ConfigError, match="set only one"):
        cfg({"from_checkpoint": True, "allow_remap": True})


def test_stage03_copies_base_map(tmp_path, tiny_verifier):
    """Stage 03 with train.finetune_from copies the map verbatim and records the mode."""
    from datasets import Dataset

    from conftest import make_config
    from eagle3.runs import Stage
    from eagle3.vocab import load_vocab, run_vocab

    vocab = json.loads((tiny_verifier / "config.json").read_text())["vocab_size"]
    cfg0 = dataclasses.replace(DRAFT, vocab_size=vocab, draft_vocab_size=64)
    ref = random_model(cfg0)
    base_dir = write_base(tmp_path, "sglang", ref)
    cfg = make_config(tmp_path, tiny_verifier, train={"finetune_from": str(base_dir)})
    s1 = Stage(cfg, 1)
    s1.dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    Dataset.from_dict({"input_ids": [rng.integers(0, vocab, 20).tolist() for _ in range(4)],
                       "loss_mask": [[1] * 20 for _ in range(4)]}
                      ).save_to_disk(str(s1.dir / "dataset"))
    s1.write_manifest(inputs={}, outputs={}, counts={}, started=0.0)
    s3 = Stage(cfg, 3)
    run_vocab(s3)
    d2t, t2d = load_vocab(s3.dir)
    assert torch.equal(d2t, ref.d2t) and torch.equal(t2d, ref.t2d)
    manifest = s3.manifest()
    assert manifest["vocab_source"] == {"mode": "from_checkpoint", "base_drafter": str(base_dir)}
    assert 0 <= manifest["counts"]["coverage"] <= 1


def test_wrapper_model_prefix_is_stripped(tmp_path):
    """Keys saved from a wrapper (`model.midlayer...`, `model.d2t`) are the same drafter, not a
    drafter missing its d2t."""
    ref = random_model()
    base_dir = write_base(tmp_path, "sglang", ref)
    edit(base_dir, tensors=lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)
                                               if k != "lm_head.weight"}))
    model = finetuned(base_dir, DRAFT, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)


class _Payload:
    def __reduce__(self):
        return (print, ("this would run arbitrary code",))


def test_malicious_bin_is_one_line_refusal(tmp_path):
    base_dir = write_base(tmp_path, "sglang", random_model())
    (base_dir / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(2), "evil": _Payload()}, base_dir / "pytorch_model.bin")
    with pytest.raises(BaseDrafterError) as e:
        load_base_drafter(base_dir)
    (msg,) = e.value.problems
    assert msg.startswith("pytorch_model.bin holds more than tensors and was refused")
    assert "\n" not in msg


KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA_DRAFT = dataclasses.replace(DRAFT, attention="mla", num_key_value_heads=4, head_dim=12,
                                q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8, draft_vocab_size=_V,
                                rope_scaling=KIMI_YARN)


@pytest.mark.parametrize("layout,eagle31", [("lightseek", False), ("lightseek", True),
                                            ("sglang", False), ("vllm", True)])
def test_mla_base_reproduces_its_logits(tmp_path, layout, eagle31):
    """An MLA drafter in lightseekorg's published layout (and in our own exports), with and
    without EAGLE-3.1's norms (kimi-k2.6-eagle3.1-mla), is read as what it is: attention, ranks,
    head dims, YaRN and norms from its config, a full vocabulary with the identity map, and a
    fine-tune starts from exactly its logits."""
    from test_convert import lightseek_mla_dir
    cfg = dataclasses.replace(MLA_DRAFT, fc_norm=eagle31, norm_output=eagle31)
    ref = random_model(cfg)
    with torch.no_grad():  # lightseek publishes bfloat16 weights
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    if layout == "lightseek":
        base_dir = lightseek_mla_dir(tmp_path / "base", ref)
    else:
        base_dir = write_base(tmp_path, layout, ref)
    base = load_base_drafter(base_dir)
    assert base.shape == cfg, base.shape
    d2t, t2d = load_base_vocab(base_dir)
    check_base(base, cfg, ref.embed_tokens.weight, d2t, t2d)
    model = finetuned(base_dir, cfg, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    assert any("draft.attention=mla" in p for p in problems(base_dir, dataclasses.replace(
        DRAFT, draft_vocab_size=_V), d2t=d2t, t2d=t2d))


@pytest.mark.parametrize("layout", ["lightseek", "speculators", "vllm"])
def test_yarn_llama_base_reproduces_its_logits(tmp_path, layout):
    """A Llama-layer drafter with Kimi's YaRN and a full vocabulary (lightseekorg's
    kimi-k2.5-eagle3, in SGLang's `midlayer.*` layout; and our own exports of one) keeps its
    rope scaling: a fine-tune starts from exactly its logits, and plain RoPE would not."""
    from test_convert import aq_medai_dir
    cfg = dataclasses.replace(DRAFT, draft_vocab_size=_V, rope_scaling=KIMI_YARN,
                              max_position_embeddings=262144)
    ref = random_model(cfg)
    if layout == "lightseek":
        base_dir = aq_medai_dir(tmp_path / "base", ref, aux=_AUX, embed=False,
                                rope_scaling=KIMI_YARN)
    else:
        base_dir = write_base(tmp_path, layout, ref)
    base = load_base_drafter(base_dir)
    assert base.shape == cfg, base.shape
    model = finetuned(base_dir, cfg, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    plain = Eagle3DraftModel(dataclasses.replace(cfg, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    assert not torch.equal(logits_of(plain)[1], logits_of(ref)[1])


@pytest.mark.parametrize("fmt", ["sglang", "speculators", "vllm"])
def test_full_vocabulary_base_has_the_identity_map_and_reproduces_its_logits(tmp_path, fmt):
    """A full-vocabulary base ships no d2t/t2d (lightseek's Kimi drafters are of this kind):
    its map is the identity, it fine-tunes exactly, a reduced map of ours is refused by name,
    and `vocab.allow_remap` moves its rows onto a reduced head by token."""
    cfg = dataclasses.replace(DRAFT, draft_vocab_size=_V)
    ref = random_model(cfg)
    base_dir = write_base(tmp_path, fmt, ref)
    assert not {"d2t", "t2d"} & set(load_file(str(base_dir / "model.safetensors")))
    base = load_base_drafter(base_dir)
    assert base.shape == cfg and base.d2t is None and base.t2d is None
    d2t, t2d = load_base_vocab(base_dir)
    assert torch.equal(d2t, torch.zeros(_V, dtype=torch.long)) and bool(t2d.all())
    check_base(base, cfg, ref.embed_tokens.weight, d2t, t2d)
    model = finetuned(base_dir, cfg, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)

    reduced = random_model(seed=1)
    assert any("draft_vocab_size" in p for p in problems(base_dir, DRAFT, d2t=reduced.d2t,
                                                         t2d=reduced.t2d))
    head = remap_lm_head(load_tensor(base.weights["lm_head.weight"]), d2t, reduced.d2t,
                         torch.randn(_V, _H))
    check_base(base, DRAFT, ref.embed_tokens.weight, reduced.d2t, reduced.t2d, allow_remap=True)
    remapped = Eagle3DraftModel(DRAFT)
    remapped.load_state_dict(base_state_dict(base, ref.embed_tokens.weight, reduced.d2t,
                                             reduced.t2d, head))
    kept = (torch.arange(_VD) + reduced.d2t)
    assert torch.equal(logits_of(remapped)[0], logits_of(ref)[0][..., kept])


def test_reduced_base_without_a_map_is_refused(tmp_path):
    """Only a full head implies its map: a reduced one without d2t/t2d would serve draft id i
    as token i."""
    base_dir = write_base(tmp_path, "sglang", random_model())
    edit(base_dir, tensors=lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(BaseDrafterError, match=f"`d2t`/`t2d` missing for a {_VD}-token draft "
                                               f"vocabulary of {_V}"):
        load_base_vocab(base_dir)
