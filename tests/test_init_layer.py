"""`train.init_layer=verifier`: a fresh drafter starts as the verifier layer after the deepest aux
state, checked against that layer's own output in transformers' Llama.

    .venv/bin/pytest tests/test_init_layer.py -q
"""

import dataclasses

import pytest
import torch

from conftest import make_config
from eagle3.model import causal_doc_mask
from eagle3.plan import _init_verdict
from eagle3.runs import StageError
from eagle3.train import build_model, init_from_verifier_layer
from eagle3.verifier import read_tensor


def _model(cfg):
    n = cfg.vocab.size_for(cfg.verifier_info.vocab_size)
    t2d = torch.zeros(cfg.verifier_info.vocab_size, dtype=torch.bool)
    t2d[:n] = True
    return build_model(cfg, torch.zeros(n, dtype=torch.long), t2d,
                       read_tensor(cfg.verifier_path, "lm_head").float())


def test_drafter_starts_as_the_verifier_layer_after_the_deepest_aux_state(tmp_path, tiny_verifier):
    from transformers import AutoModelForCausalLM

    cfg = make_config(tmp_path, tiny_verifier, train={"init_layer": "verifier"})
    model = _model(cfg)
    H = model.cfg.hidden_size
    with torch.no_grad():  # silence the next token: the layer then sees only the verifier state
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(model.layers[0].self_attn, proj).weight[:, :H] = 0
    verifier = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    layer = cfg.verifier_info.aux_layer_ids[-1]  # HF index: the input of layers[layer]
    captured = {}
    verifier.model.layers[layer].register_forward_hook(
        lambda mod, args, out: captured.update(out=out[0] if isinstance(out, tuple) else out))
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        states = verifier(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in cfg.verifier_info.aux_layer_ids], dim=-1)
        h, _ = model.step(model.project(aux), ids, torch.arange(24)[None],
                          causal_doc_mask(torch.zeros(1, 24, dtype=torch.long)), model.new_cache())
    torch.testing.assert_close(h, captured["out"], atol=1e-5, rtol=1e-5)


def test_random_init_is_untouched(tmp_path, tiny_verifier):
    torch.manual_seed(0)
    random = _model(make_config(tmp_path, tiny_verifier))
    fc = random.fc.weight
    assert fc[:, :-fc.shape[0]].abs().sum() > 0, "random init must not zero fc"


def test_mismatched_geometry_or_architecture_is_one_clear_error(tmp_path, tiny_verifier):
    cfg = make_config(tmp_path, tiny_verifier, train={"init_layer": "verifier"},
                      draft={"intermediate_size": 96})
    with pytest.raises(StageError, match=r"mlp.gate_proj is \(128, 64\).*train.init_layer=random"):
        _model(cfg)
    verdict = _init_verdict(cfg)  # the plan says so from the headers, before any stage runs
    assert verdict.ok is False and "mlp.gate_proj is (128, 64)" in verdict.detail
    ok = _init_verdict(make_config(tmp_path, tiny_verifier, train={"init_layer": "verifier"}))
    assert ok.ok is True, ok.detail
    cfg = make_config(tmp_path, tiny_verifier)
    model = _model(cfg)
    info = dataclasses.replace(cfg.verifier_info, architecture="DeepseekV3ForCausalLM")
    with pytest.raises(StageError, match="Llama-shaped verifier.*DeepseekV3ForCausalLM"):
        init_from_verifier_layer(model, cfg.verifier_path, info)
