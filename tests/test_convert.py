"""`05_fix_keys.py --from`: any drafter directory in, every engine layout out, checked against the
verifier when given; the streaming safetensors writer; configs as users read them.

    .venv/bin/pytest tests/test_convert.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, TINY_HIDDEN
from eagle3 import convert, formats, weights_io
from eagle3.model import DraftModelConfig, Eagle3DraftModel
from eagle3.verifier import read_tensor

_VD = 512
_AUX = [1, 2, 3]


def draft_config(vocab: int, hidden: int = TINY_HIDDEN, heads: int = 4,
                 kv_heads: int = 2) -> DraftModelConfig:
    return DraftModelConfig(hidden_size=hidden, target_hidden_size=hidden, num_aux=3,
                            intermediate_size=96, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=hidden // heads,
                            num_layers=1, rms_norm_eps=1e-5,
                            rope_theta=10000.0, max_position_embeddings=2048, vocab_size=vocab,
                            draft_vocab_size=_VD)


def drafter_for(verifier: Path, seed: int = 0, heads: int = 4, kv_heads: int = 2
                ) -> Eagle3DraftModel:
    """A random drafter shaped for `verifier`, with its embedding."""
    embed = read_tensor(verifier, "embed")
    torch.manual_seed(seed)
    m = Eagle3DraftModel(draft_config(embed.shape[0], embed.shape[1], heads, kv_heads))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        m.embed_tokens.weight.copy_(embed)
        chosen = torch.randperm(embed.shape[0])[:_VD].sort().values
        m.d2t.copy_(chosen - torch.arange(_VD))
        m.t2d.zero_()
        m.t2d[chosen] = True
    return m


def aq_medai_dir(out: Path, model: Eagle3DraftModel, aux=_AUX, embed: bool = True,
                 drop=(), **config: Any) -> Path:
    """SGLang/AQ-MedAI layout: midlayer.* keys, flat config, aux ids in eagle_config; `config`
    adds fields (lightseekorg's Llama drafter: its YaRN `rope_scaling`)."""
    state = {k: v for k, v in model.state_dict().items() if embed or k != "embed_tokens.weight"}
    tensors = {formats.rename_key(k, "speculators", "sglang"): v.contiguous()
               for k, v in state.items() if k not in drop}
    d = model.cfg
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "max_position_embeddings": d.max_position_embeddings, "vocab_size": d.vocab_size,
        "draft_vocab_size": d.draft_vocab_size, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}, **config}))
    return out


def lightseek_mla_dir(out: Path, model: Eagle3DraftModel, aux=_AUX, embed: bool = False,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """lightseekorg's MLA layout (kimi-k2.5-eagle3-mla): the rehearsal's writer of it."""
    from eagle3.rehearsal import write_lightseek_mla_layout
    state = {k: v for k, v in model.state_dict().items() if embed or k != "embed_tokens.weight"}
    return write_lightseek_mla_layout(out, model.cfg, state, aux, dtype)


def speculators_dir(out: Path, model: Eagle3DraftModel) -> Path:
    """A drafter written by speculators' own `Eagle3DraftModel.save_pretrained`."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    d = model.cfg
    layer = LlamaConfig(hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=d.num_attention_heads,
                        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
                        rms_norm_eps=d.rms_norm_eps, vocab_size=d.vocab_size,
                        max_position_embeddings=d.max_position_embeddings,
                        rope_theta=d.rope_theta)
    spec = SpecEagle3(Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=d.draft_vocab_size,
        norm_before_residual=False, norm_before_fc=False, fc_norm=d.fc_norm,
        norm_output=d.norm_output,
        embed_requires_grad=False, eagle_aux_hidden_state_layer_ids=_AUX,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path="tiny", architectures=["LlamaForCausalLM"]))))
    state = dict(model.state_dict())
    state["verifier_lm_head.weight"] = torch.zeros(d.draft_vocab_size, d.hidden_size)
    state["verifier_norm.weight"] = torch.ones(d.hidden_size)
    spec.load_state_dict(state, strict=True)
    spec.save_pretrained(str(out))
    return out


def convert_dir(src: Path, out: Path, *extra: str) -> dict:
    return convert.run_convert(convert._parse(["--from", str(src), "--out", str(out), *extra]))


def shipped(model: Eagle3DraftModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}


def test_speculators_save_pretrained_to_every_layout(tmp_path, tiny_verifier):
    model = drafter_for(tiny_verifier)
    src = speculators_dir(tmp_path / "spec", model)
    report = convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    assert report["layout"] == "speculators" and report["unchecked"] == []
    assert sorted(report["formats"]) == ["sglang", "speculators", "vllm"]
    vllm = load_file(str(tmp_path / "out" / "vllm" / "model.safetensors"))
    assert vllm.keys() == shipped(model).keys()  # no embedding, nothing of speculators' own
    assert all(torch.equal(vllm[k], v) for k, v in shipped(model).items())
    sglang = load_file(str(tmp_path / "out" / "sglang" / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in sglang and "embed_tokens.weight" not in sglang
    # Llama verifier: SGLang adds one to every id, so [1,2,3] is written [0,1,2].
    assert report["formats"]["sglang"]["aux_layer_ids_written"] == [0, 1, 2]
    card = (tmp_path / "out" / "sglang" / "README.md").read_text()
    assert f"--speculative-draft-model-path {tmp_path / 'out' / 'sglang'}" in card
    assert str(tmp_path / "out" / "vllm") in card and "--speculative-algorithm EAGLE3" in card
    # A rerun keeps every intact directory.
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.safetensors")}
    convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())


def test_speculators_eagle31_drafter_through_from(tmp_path, tiny_verifier):
    """A speculators-saved EAGLE-3.1 drafter (`fc_norm`, `norm_output`) goes through `--from`
    to every format with its norms and both flags, and the vLLM export's weights rebuild a
    model that computes what the source does."""
    import dataclasses

    from test_finetune import logits_of

    base = drafter_for(tiny_verifier)
    model = Eagle3DraftModel(dataclasses.replace(base.cfg, fc_norm=True, norm_output=True))
    with torch.no_grad():
        model.load_state_dict(base.state_dict(), strict=False)
        for norm in model.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    src = speculators_dir(tmp_path / "spec", model)
    report = convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    assert report["draft_config"]["fc_norm"] and report["draft_config"]["norm_output"]
    for fmt in ("vllm", "sglang", "speculators"):
        cfg = json.loads((tmp_path / "out" / fmt / "config.json").read_text())
        assert cfg["fc_norm"] is True and cfg["norm_output"] is True, fmt
        keys = load_file(str(tmp_path / "out" / fmt / "model.safetensors")).keys()
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= keys, fmt
    rebuilt = Eagle3DraftModel(model.cfg)
    state = load_file(str(tmp_path / "out" / "vllm" / "model.safetensors"))
    rebuilt.load_state_dict({**state, "embed_tokens.weight": model.embed_tokens.weight})
    for a, b in zip(logits_of(model), logits_of(rebuilt)):
        assert torch.equal(a, b)


def test_aq_medai_layout_through_the_script(tmp_path, tiny_verifier):
    model = drafter_for(tiny_verifier, seed=1)
    # Written for SGLang and a Llama verifier: [0,1,2] captures HF layers [1,2,3].
    src = aq_medai_dir(tmp_path / "aq", model, aux=[0, 1, 2])
    out = subprocess.run([sys.executable, "05_fix_keys.py", "--from", str(src), "--out",
                          str(tmp_path / "out"), "--verifier", str(tiny_verifier),
                          "--formats", "vllm,sglang", "--dtype", "bfloat16"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "aux ids [1, 2, 3]" in out.stdout and "aux ids [0, 1, 2]" in out.stdout
    cfg = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["dtype"] == "bfloat16"
    vllm = load_file(str(tmp_path / "out" / "vllm" / "model.safetensors"))
    assert torch.equal(vllm["fc.weight"], model.fc.weight.detach().to(torch.bfloat16))
    assert vllm["d2t"].dtype == torch.int64 and vllm["t2d"].dtype == torch.bool


def test_without_the_verifier_what_needs_it_is_reported_unchecked(tmp_path, tiny_verifier):
    model = drafter_for(tiny_verifier, seed=2)
    src = speculators_dir(tmp_path / "spec", model)  # names a Llama verifier in its config
    report = convert_dir(src, tmp_path / "out")
    assert sorted(report["formats"]) == ["sglang", "speculators", "vllm"]
    assert any("embedding against the verifier" in u for u in report["unchecked"])
    assert any("ships `embed_tokens`" in u for u in report["unchecked"])
    # A midlayer.* source says nothing of its verifier: SGLang's ids cannot be read.
    aq = aq_medai_dir(tmp_path / "aq", model)
    with pytest.raises(convert.StageError, match="pass --verifier PATH"):
        convert_dir(aq, tmp_path / "out2")


def test_foreign_embedding_and_missing_lm_head_are_refused(tmp_path, tiny_verifier):
    model = drafter_for(tiny_verifier, seed=3)
    with torch.no_grad():
        model.embed_tokens.weight[7] += 0.5
    src = aq_medai_dir(tmp_path / "aq", model, aux=[0, 1, 2], drop=("lm_head.weight",))
    with pytest.raises(convert.StageError) as e:
        convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    assert "TorchSpec#38" in str(e.value) and "max abs diff 0.5" in str(e.value)
    assert "sglang#27829" in str(e.value)
    assert not any((tmp_path / "out").glob("*/model.safetensors"))


def test_out_must_not_overlap_the_source(tmp_path, tiny_verifier):
    src = aq_medai_dir(tmp_path / "aq", drafter_for(tiny_verifier))
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src / "exports"):
        with pytest.raises(convert.StageError, match="overlaps --from"):
            convert_dir(src, out, "--verifier", str(tiny_verifier))
    assert sorted(p.name for p in src.iterdir()) == before


def test_deepseek_family_source_needs_its_sglang_version(tmp_path):
    """AQ-MedAI's Kimi drafters write [2,30,58] for SGLang before PR #25454 (meaning HF
    layers [3,31,59]); after it the same ids mean [2,30,58]. The converter asks."""
    verifier = tmp_path / "kimi-like"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 1000,
        "num_attention_heads": 4, "intermediate_size": 96}))
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(1000))
    model.t2d[:_VD] = True
    src = aq_medai_dir(tmp_path / "aq", model, aux=[2, 4, 5], embed=False)
    with pytest.raises(convert.StageError, match="--source-sglang pre-25454"):
        convert_dir(src, tmp_path / "out", "--verifier", str(verifier))
    report = convert_dir(src, tmp_path / "out", "--verifier", str(verifier),
                         "--source-sglang", "pre-25454")
    assert report["aux_layer_ids_internal"] == [3, 5, 6]
    vllm = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]


def test_pickled_source_is_read_weights_only(tmp_path, tiny_verifier):
    model = drafter_for(tiny_verifier, seed=4)
    src = aq_medai_dir(tmp_path / "aq", model, aux=[0, 1, 2])
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, src / "pytorch_model.bin")
    report = convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier),
                         "--formats", "vllm")
    assert report["formats"]["vllm"]["num_keys"] == len(shipped(model))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streaming_writer_equals_safetensors_save_file(tmp_path, dtype):
    tensors = {"a.weight": torch.randn(5, 7), "b": torch.randn(3).to(torch.bfloat16),
               "d2t": torch.arange(4, dtype=torch.int64), "t2d": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    lazy = weights_io.open_file(tmp_path / "ref.safetensors")
    cast = {k: dtype for k, v in tensors.items() if dtype and v.is_floating_point()}
    weights_io.write_safetensors(tmp_path / "out.safetensors", lazy, cast)
    got = load_file(str(tmp_path / "out.safetensors"))
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(got[k], v.to(cast.get(k, v.dtype))), k
    assert oct((tmp_path / "out.safetensors").stat().st_mode & 0o777) == "0o644"


def test_exported_configs_read_as_written_and_through_transformers(tmp_path, tiny_verifier):
    """No float32 noise (an eps stored as float32 reads 9.999999747378752e-06); transformers
    parses what the engines parse: head_dim, RoPE, draft vocabulary, aux ids."""
    from transformers import AutoConfig

    model = drafter_for(tiny_verifier, seed=5)
    model.cfg = DraftModelConfig(**{**model.cfg.to_dict(),
                                    "rms_norm_eps": float(torch.tensor(1e-5).item())})
    src = aq_medai_dir(tmp_path / "aq", model, aux=[0, 1, 2])
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 9.999999747378752e-06  # the noise, in the source
    convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    for fmt, ids in (("vllm", [1, 2, 3]), ("sglang", [0, 1, 2])):
        text = (tmp_path / "out" / fmt / "config.json").read_text()
        assert '"rms_norm_eps": 1e-05' in text and "9.99999" not in text
        parsed = AutoConfig.from_pretrained(tmp_path / "out" / fmt)
        assert parsed.head_dim == TINY_HIDDEN // 4 and parsed.draft_vocab_size == _VD
        assert parsed.rope_parameters["rope_theta"] == 10000.0
        assert parsed.rms_norm_eps == 1e-5
        assert parsed.eagle_config["eagle_aux_hidden_state_layer_ids"] == ids


def test_model_card_carries_the_runs_training_and_measured_acceptance(tmp_path, tiny_verifier):
    """Publishing a run's export with --from: the card names the training and stage 06's
    measured acceptance, and serve commands for both engines' exports."""
    run = tmp_path / "runs" / "r"
    src = speculators_dir(tmp_path / "spec", drafter_for(tiny_verifier))
    convert_dir(src, run / "05_export", "--verifier", str(tiny_verifier), "--formats", "vllm")
    record_file = run / "05_export" / "vllm" / "eagle3_export.json"
    record = json.loads(record_file.read_text())
    record["source"]["checkpoint"] = str(run / "04_train" / "step-7")
    record_file.write_text(json.dumps(record))
    (run / "05_export" / "report.json").write_text(json.dumps({"provenance": {
        "training": {"data": ["sharegpt"], "train_samples": 830, "step": 7, "epochs": 2,
                     "tokens_seen": 361696, "regenerated_by_verifier": "vllm"},
        "vocab": {"coverage": 0.952}, "draft_sample": {"vllm": "probabilistic"}}}))
    (run / "06_bench").mkdir(parents=True)
    (run / "06_bench" / "results.json").write_text(json.dumps({"results": [
        {"engine": "vllm", "run": "3/1/4", "depth": {"steps": 3}, "concurrency": 4,
         "prompt_set": "mtbench", "temperature": 0.0, "mean_acceptance_length": 1.5,
         "speedup": 1.2}]}))
    convert_dir(run / "05_export" / "vllm", tmp_path / "pub", "--verifier", str(tiny_verifier))
    card = (tmp_path / "pub" / "sglang" / "README.md").read_text()
    assert "| vllm | 3/1/4 | 4 | mtbench | 0 | 1.500 | 1.20x |" in card
    assert "step 7, 361696 tokens, 2 epochs" in card and "covering 95.2%" in card
    assert f"--speculative-draft-model-path {tmp_path / 'pub' / 'sglang'}" in card
    assert f'"model": "{tmp_path / "pub" / "vllm"}"' in card
    assert '"draft_sample_method": "probabilistic"' in card  # as the run's stage 06 served it


@pytest.mark.parametrize("ships_map", [False, True])
def test_full_vocabulary_drafter_through_from(tmp_path, tiny_verifier, ships_map):
    """A full-vocabulary drafter in SGLang's layout (lightseek's Kimi drafters are of this kind),
    without a map or with an identity one (some trainers save it): every format is written
    without d2t/t2d, which vLLM could not load, and validates."""
    import dataclasses
    embed = read_tensor(tiny_verifier, "embed")
    vocab = embed.shape[0]
    torch.manual_seed(5)
    model = Eagle3DraftModel(dataclasses.replace(draft_config(vocab, embed.shape[1]),
                                                 draft_vocab_size=vocab))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model.embed_tokens.weight.copy_(embed)
    src = aq_medai_dir(tmp_path / "full", model, aux=[0, 1, 2])
    if ships_map:
        tensors = load_file(str(src / "model.safetensors"))
        save_file({**tensors, "d2t": torch.zeros(vocab, dtype=torch.int64),
                   "t2d": torch.ones(vocab, dtype=torch.bool)}, str(src / "model.safetensors"))
    report = convert_dir(src, tmp_path / "out", "--verifier", str(tiny_verifier))
    assert sorted(report["formats"]) == ["sglang", "speculators", "vllm"]
    for fmt, record in report["formats"].items():
        assert record["full_vocab"] and record["draft_vocab_size"] == vocab
        written = load_file(str(tmp_path / "out" / fmt / "model.safetensors"))
        assert not {"d2t", "t2d"} & set(written)
        lm_head = written["lm_head.weight"]
        assert torch.equal(lm_head, model.lm_head.weight.detach().to(lm_head.dtype))
