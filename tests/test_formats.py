"""Export layouts and their validation (eagle3/formats.py, eagle3/export.py), on a tiny drafter.

    .venv/bin/pytest tests/test_formats.py -q

Every silent-failure mode of docs/engines.md that lives in the exported files must make
`validate_export` raise: each test corrupts one thing in a valid export and expects the
problem to be named.
"""

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3 import formats
from eagle3.formats import ExportValidationError, FormatError, validate_export, write_export
from eagle3.model import DraftModelConfig, Eagle3DraftModel

_VOCAB = 100
_DRAFT_VOCAB = 32
_HIDDEN = 32
_AUX = [2, 4, 6]

DRAFT = DraftModelConfig(hidden_size=_HIDDEN, target_hidden_size=_HIDDEN, num_aux=3,
                         intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=256, vocab_size=_VOCAB,
                         draft_vocab_size=_DRAFT_VOCAB)


def make_state(draft: DraftModelConfig = DRAFT) -> dict[str, torch.Tensor]:
    """A random drafter's checkpoint tensors with a consistent random reduced vocabulary."""
    model = Eagle3DraftModel(draft)
    targets = torch.randperm(draft.vocab_size)[:draft.draft_vocab_size].sort().values
    model.t2d.zero_()
    model.t2d[targets] = True
    model.d2t.copy_(targets - torch.arange(draft.draft_vocab_size))
    return {k: v.clone() for k, v in model.trainable_state_dict().items()}


CTX = formats.ExportContext("/verifiers/tiny", "LlamaForCausalLM")


def export(tmp_path: Path, fmt: str, state=None, draft=DRAFT, aux=_AUX, ctx=CTX,
           dtype=None) -> Path:
    out = tmp_path / fmt
    out.mkdir()
    write_export(out, fmt, make_state(draft) if state is None else state, draft, aux, ctx,
                 dtype)
    return out


def rewrite(out: Path, edit_tensors=None, edit_config=None) -> None:
    """Corrupt an export in place: edit_tensors(dict) / edit_config(dict) mutate in place."""
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))


def problems_of(out: Path, fmt: str, ctx=CTX) -> str:
    with pytest.raises(ExportValidationError) as e:
        validate_export(out, fmt, DRAFT, _AUX, ctx)
    return "\n".join(e.value.problems)


# ---------------------------------------------------------------------------------------------
# Writing and key maps


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_each_format_exports_and_validates(tmp_path, fmt):
    out = export(tmp_path, fmt)
    summary = validate_export(out, fmt, DRAFT, _AUX, CTX)
    keys = set(load_file(str(out / "model.safetensors")))
    cfg = json.loads((out / "config.json").read_text())
    assert "d2t" in keys and "t2d" in keys and "lm_head.weight" in keys
    assert not any(k.startswith(("model.", "embed_tokens")) for k in keys)
    assert cfg["norm_before_residual"] is False
    if fmt == "sglang":
        assert all(not k.startswith("layers.") for k in keys)
        assert "midlayer.self_attn.q_proj.weight" in keys
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        # Written minus one: captures HF hidden_states[2,4,6] on SGLang before and after
        # PR #25454 (docs/engines.md).
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert summary["aux_ids_valid_for"] == ["sglang pre-25454", "sglang post-25454"]
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
    else:
        assert "layers.0.self_attn.q_proj.weight" in keys
        assert cfg["eagle_aux_hidden_state_layer_ids"] == _AUX
    if fmt == "vllm":
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == _AUX
        assert cfg["draft_vocab_size"] == _DRAFT_VOCAB and cfg["vocab_size"] == _VOCAB
        assert cfg["tie_word_embeddings"] is False
        assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 10000.0
    if fmt == "speculators":
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == "/verifiers/tiny"
        assert cfg["transformer_layer_config"]["vocab_size"] == _VOCAB
    assert summary["aux_layer_ids_internal"] == _AUX


def test_key_maps_round_trip():
    state = make_state()
    sglang = formats.to_layout(state, "sglang")
    assert formats.detect_layout(sglang) == "sglang"
    assert formats.detect_layout(state) == "speculators"
    back = formats.to_layout(sglang, "speculators")
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert formats.LAYER0_PREFIX == {"speculators": "layers.0.", "sglang": "midlayer."}


def test_compile_prefix_is_stripped_on_export(tmp_path):
    compiled = {f"_orig_mod.{k}": v for k, v in make_state().items()}
    assert set(formats.strip_compile_prefix(compiled)) == set(make_state())
    out = export(tmp_path, "vllm", state=compiled)
    validate_export(out, "vllm", DRAFT, _AUX, CTX)


def test_sglang_export_of_sglang_layout_checkpoint(tmp_path):
    out = export(tmp_path, "vllm", state=formats.to_layout(make_state(), "sglang"))
    assert "layers.0.mlp.up_proj.weight" in load_file(str(out / "model.safetensors"))


def test_sglang_refuses_multi_layer_drafter(tmp_path):
    two = DraftModelConfig(**{**DRAFT.to_dict(), "num_layers": 2})
    with pytest.raises(FormatError, match="one draft layer"):
        export(tmp_path, "sglang", draft=two)
    out = export(tmp_path, "vllm", draft=two)  # vLLM serves extra plain layers
    assert "layers.1.self_attn.q_proj.weight" in load_file(str(out / "model.safetensors"))


def test_sglang_aux_conventions():
    """SGLang's Llama/Qwen/Gemma targets add +1 to every config id (all versions); its
    DeepSeek/Kimi targets add +1 only when the first id is 1 (after PR #25454) or always
    (before). `tests/test_sglang_engine.py` checks these rules against SGLang's own code."""
    both = ["pre-25454", "post-25454"]
    ds, llama = "DeepseekV3ForCausalLM", "LlamaForCausalLM"
    # Kimi's [2,30,58] and any set starting at 2: one config valid on every SGLang.
    assert formats.sglang_written([2, 30, 58], "auto", ds) == ([1, 29, 57], both)
    assert formats.sglang_written([2, 30, 58], "post-25454", ds) == ([1, 29, 57], both)
    assert formats.sglang_written([2, 15, 27], "auto", llama) == ([1, 14, 26], both)
    assert formats.sglang_written([3, 15, 27], "auto", llama) == ([2, 14, 26], both)
    # No robust choice on DeepSeek: auto takes current SGLang's rule and says so.
    assert formats.sglang_written([3, 15, 27], "auto", ds) == ([3, 15, 27], ["post-25454"])
    assert formats.sglang_written([3, 15, 27], "pre-25454", ds) == ([2, 14, 26], ["pre-25454"])
    with pytest.raises(FormatError, match="no auto SGLang config"):
        formats.sglang_written([1, 15, 27], "auto", ds)
    assert formats.sglang_written([1, 15, 27], "pre-25454", ds) == ([0, 14, 26], ["pre-25454"])
    assert formats.sglang_written([1, 15, 27], "auto", llama) == ([0, 14, 26], both)
    # The reading direction inverts the writing one on every version an id set is valid for.
    for ids, rule, arch in (([2, 30, 58], "auto", ds), ([3, 15, 27], "auto", ds),
                            ([1, 15, 27], "pre-25454", ds), ([3, 15, 27], "auto", llama)):
        written, valid = formats.sglang_written(ids, rule, arch)
        assert all(formats.sglang_captured(written, arch, v) == ids for v in valid)


def test_deepseek_post_25454_export_writes_ids_as_is(tmp_path):
    post = formats.ExportContext("/verifiers/tiny", "DeepseekV3ForCausalLM", 3, "post-25454")
    draft = dataclasses.replace(DRAFT)
    out = export(tmp_path, "sglang", ctx=post, aux=[3, 4, 6])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 6]
    summary = validate_export(out, "sglang", draft, [3, 4, 6], post)
    assert summary["aux_ids_valid_for"] == ["sglang post-25454"]
    # the same directory read for a Llama target (always +1) has other ids than expected
    with pytest.raises(ExportValidationError, match=r"expected \[2, 3, 5\]"):
        validate_export(out, "sglang", draft, [3, 4, 6], CTX)


def test_export_dtype_casts_floats_only(tmp_path):
    out = export(tmp_path, "vllm", dtype="bfloat16")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------
# The validator rejects each silent-failure mode


def test_rejects_layers_keys_in_sglang_export(tmp_path):
    out = export(tmp_path, "sglang")
    rewrite(out, edit_tensors=lambda t: t.update(
        {"layers.0.mlp.up_proj.weight": t.pop("midlayer.mlp.up_proj.weight")}))
    msg = problems_of(out, "sglang")
    assert "drops them silently" in msg and "layers.0.mlp.up_proj.weight" in msg


def test_rejects_missing_d2t(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t.pop("d2t"))
    assert "`d2t` missing" in problems_of(out, "vllm")


def test_rejects_absolute_d2t(tmp_path):
    state = make_state()
    state["d2t"] = state["d2t"] + torch.arange(_DRAFT_VOCAB)  # absolute target ids
    out = export(tmp_path, "vllm", state=state)
    assert "absolute target ids" in problems_of(out, "vllm")


def test_rejects_absolute_d2t_of_identity_prefix(tmp_path):
    state = make_state()
    state["t2d"] = torch.zeros(_VOCAB, dtype=torch.bool)
    state["t2d"][:_DRAFT_VOCAB] = True
    state["d2t"] = torch.arange(_DRAFT_VOCAB)  # absolute ids of the prefix; offsets are zeros
    out = export(tmp_path, "sglang", state=state)
    assert "d2t: not valid offsets" in problems_of(out, "sglang")


def test_rejects_missing_lm_head(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t.pop("lm_head.weight"))
    assert "`lm_head.weight` missing" in problems_of(out, "vllm")


def test_rejects_model_prefix(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t.update({"model.norm.weight": t.pop("norm.weight")}))
    msg = problems_of(out, "vllm")
    assert "starts with `model.`" in msg and "missing tensor `norm.weight`" in msg


def test_rejects_misshaped_tensor(tmp_path):
    out = export(tmp_path, "speculators")
    rewrite(out, edit_tensors=lambda t: t.update({"fc.weight": torch.zeros(_HIDDEN, _HIDDEN)}))
    assert "`fc.weight` has shape [32, 32], expected [32, 96]" in problems_of(out, "speculators")


def test_rejects_unexpected_key(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t.update({"input_norm.weight": torch.ones(96)}))
    assert "unexpected tensor `input_norm.weight`" in problems_of(out, "vllm")


def test_rejects_missing_key(tmp_path):
    out = export(tmp_path, "sglang")
    rewrite(out, edit_tensors=lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert "missing tensor `midlayer.hidden_norm.weight`" in problems_of(out, "sglang")


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_rejects_absent_norm_before_residual(tmp_path, fmt):
    out = export(tmp_path, fmt)
    rewrite(out, edit_config=lambda c: c.pop("norm_before_residual"))
    assert "`norm_before_residual` absent" in problems_of(out, fmt)


def test_rejects_wrong_dtypes_and_config_fields(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t.update({"d2t": t["d2t"].to(torch.int32),
                                                  "t2d": t["t2d"].to(torch.uint8)}),
            edit_config=lambda c: [c.pop("eagle_aux_hidden_state_layer_ids"),
                                   c.pop("draft_vocab_size"),
                                   c.update(architectures=["LlamaForCausalLM"])])
    msg = problems_of(out, "vllm")
    for needle in ("`d2t` has dtype torch.int32", "`t2d` has dtype torch.uint8",
                   "aux ids `eagle_aux_hidden_state_layer_ids` absent",
                   "`draft_vocab_size` missing", "`architectures`"):
        assert needle in msg


def test_lists_every_problem_at_once(tmp_path):
    out = export(tmp_path, "sglang")
    rewrite(out, edit_tensors=lambda t: [t.pop("d2t"), t.pop("lm_head.weight")],
            edit_config=lambda c: c.pop("norm_before_residual"))
    with pytest.raises(ExportValidationError) as e:
        validate_export(out, "sglang", DRAFT, _AUX, CTX)
    assert len(e.value.problems) == 3
    assert "3 problem(s)" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Stage 05 on a fake training run


def _with_aux(cfg):
    """Explicit aux ids: the derived default (2, N//2, N-3) repeats ids on a 4-layer verifier."""
    return dataclasses.replace(cfg, verifier=dataclasses.replace(cfg.verifier,
                                                                 aux_layer_ids=[2, 3, 4]))


def _fake_train_run(tmp_path, tiny_verifier, state=None) -> "object":
    """A finished stage 04 holding one checkpoint written by the real saver."""
    from conftest import make_config
    from eagle3 import checkpoint
    from eagle3.runs import Stage

    cfg = _with_aux(make_config(tmp_path, tiny_verifier, export={"formats": ["vllm", "sglang"]}))
    info = cfg.verifier_info
    draft = DraftModelConfig(**{**DRAFT.to_dict(), "hidden_size": info.hidden_size,
                                "target_hidden_size": info.hidden_size,
                                "vocab_size": info.vocab_size, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": info.hidden_size // 4})
    s4 = Stage(cfg, 4)
    s4.dir.mkdir(parents=True)
    aux = list(info.aux_layer_ids)
    spec = formats.speculators_config(draft, aux, formats.ExportContext(
        str(cfg.verifier_path), info.architecture))
    path = checkpoint.save(s4.dir, 2, make_state(draft) if state is None else state(draft),
                           draft, aux, spec, {"world_size": 1}, recipe={})
    checkpoint.set_best(s4.dir, path)
    s4.write_manifest(inputs={}, outputs={}, counts={}, started=time.time())
    return cfg


def test_run_export_writes_validates_and_resumes(tmp_path, tiny_verifier):
    from eagle3.export import run_export
    from eagle3.runs import Stage

    cfg = _fake_train_run(tmp_path, tiny_verifier)
    ckpt_bytes = (Stage(cfg, 4).dir / "step-2" / "model.safetensors").read_bytes()
    stage = Stage(cfg, 5)
    run_export(stage)
    report = json.loads((stage.dir / "report.json").read_text())
    assert set(report["formats"]) == {"vllm", "sglang"}
    assert report["formats"]["sglang"]["aux_layer_ids_written"] == [1, 2, 3]  # robust rule
    assert report["formats"]["vllm"]["checks_passed"]
    assert stage.is_done()
    assert (Stage(cfg, 4).dir / "step-2" / "model.safetensors").read_bytes() == ckpt_bytes

    # A crash after the vLLM dir: sglang missing, a stale tmp dir left, no manifest.
    import shutil
    shutil.rmtree(stage.dir / "sglang")
    stage.manifest_path.unlink()
    (stage.dir / ".sglang.tmp-999").mkdir()
    vllm_mtime = (stage.dir / "vllm" / "model.safetensors").stat().st_mtime_ns
    run_export(stage)
    assert stage.is_done() and (stage.dir / "sglang" / "config.json").is_file()
    assert not (stage.dir / ".sglang.tmp-999").exists()
    assert (stage.dir / "vllm" / "model.safetensors").stat().st_mtime_ns == vllm_mtime


def test_run_export_requires_training(tmp_path, tiny_verifier):
    from conftest import make_config
    from eagle3.export import run_export
    from eagle3.runs import Stage, StageError

    cfg = _with_aux(make_config(tmp_path, tiny_verifier))
    with pytest.raises(StageError, match="04_train.py"):
        run_export(Stage(cfg, 5))


def test_rejects_non_finite_weights(tmp_path):
    out = export(tmp_path, "vllm")
    rewrite(out, edit_tensors=lambda t: t["fc.weight"].view(-1).__setitem__(3, float("nan")))
    assert "`fc.weight` has NaN or infinite values" in problems_of(out, "vllm")


def test_run_export_refuses_non_finite_checkpoint(tmp_path, tiny_verifier):
    from eagle3.export import run_export
    from eagle3.runs import Stage, StageError

    def nan_state(draft):
        state = make_state(draft)
        state["lm_head.weight"][0, 0] = float("inf")
        return state
    cfg = _fake_train_run(tmp_path, tiny_verifier, state=nan_state)
    with pytest.raises(StageError, match="lm_head.weight` has NaN or infinite values"):
        run_export(Stage(cfg, 5))
    assert not (Stage(cfg, 5).dir / "vllm").exists()


def test_speculators_export_names_the_verifier_by_absolute_path(tmp_path, tiny_verifier,
                                                                 monkeypatch):
    """`vllm serve DIR` starts the verifier named in the speculators config: a relative path
    would work only from the directory the export was made in."""
    from eagle3.export import run_export
    from eagle3.runs import Stage

    monkeypatch.chdir(tiny_verifier.parent)
    cfg = _fake_train_run(tmp_path, tiny_verifier)
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export,
                                                              formats=["speculators"]),
                              verifier=dataclasses.replace(cfg.verifier,
                                                           path=tiny_verifier.name))
    run_export(Stage(cfg, 5))
    conf = json.loads((Stage(cfg, 5).dir / "speculators" / "config.json").read_text())
    assert conf["speculators_config"]["verifier"]["name_or_path"] == str(tiny_verifier.resolve())


@pytest.mark.parametrize("mla,flag", [(True, True), (False, False), (None, True)])
def test_model_card_gives_the_sglang_drafter_its_own_backend_beside_an_mla_verifier(
        tmp_path, mla, flag):
    """On Blackwell SGLang gives an MLA verifier (Kimi, DeepSeek) trtllm_mla, which the
    Llama-layer drafter inherits and cannot run: the card's SGLang command carries
    --speculative-draft-attention-backend flashinfer unless the verifier is known not to be MLA
    (flashinfer serves the drafter beside any verifier on NVIDIA GPUs)."""
    from eagle3.model_card import model_card

    out = export(tmp_path, "sglang")
    summary = validate_export(out, "sglang", DRAFT, _AUX, CTX)
    card = model_card("sglang", summary, {"verifier": "/verifiers/tiny", "verifier_mla": mla},
                      out, {"sglang": out, "vllm": tmp_path / "vllm"})
    sglang = next(line for line in card.splitlines() if "sglang.launch_server" in line)
    vllm = next(line for line in card.splitlines() if line.startswith("vllm serve"))
    assert ("--speculative-draft-attention-backend flashinfer" in sglang) is flag
    assert "--speculative-draft-attention-backend" not in vllm
    assert f"--speculative-draft-model-path {out}" in sglang


def test_run_export_card_knows_whether_the_verifier_is_mla(tmp_path, tiny_verifier):
    """Stage 05 records the verifier's attention (a Llama: not MLA), so its card's SGLang
    command leaves the drafter's backend to SGLang."""
    from eagle3.export import run_export
    from eagle3.runs import Stage

    cfg = _fake_train_run(tmp_path, tiny_verifier)
    run_export(Stage(cfg, 5))
    report = json.loads((Stage(cfg, 5).dir / "report.json").read_text())
    assert report["provenance"]["verifier_mla"] is False
    card = (Stage(cfg, 5).dir / "sglang" / "README.md").read_text()
    assert "sglang.launch_server" in card and "--speculative-draft-attention-backend" not in card


def test_the_model_card_serves_a_sharded_remote_code_verifier_as_the_run_did(tmp_path):
    """Kimi's card: every serve command carries the run's tensor parallelism and
    --trust-remote-code, the speculators directory served alone included."""
    from eagle3.model_card import serve_commands
    out = serve_commands("speculators", tmp_path / "speculators", {"vllm": tmp_path / "vllm",
                                                                   "sglang": tmp_path / "sg"},
                         "/models/Kimi-K2.5", True, mla=True, tp={"vllm": 8, "sglang": 8})
    assert "--tensor-parallel-size 8" in out["vllm"] and "--tp-size 8" in out["sglang"]
    alone = out["vllm (this directory alone)"]
    assert "--tensor-parallel-size 8" in alone and alone.endswith("--trust-remote-code")


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_config_is_judged_as_transformers_parses_it(tmp_path, fmt):
    """A config whose JSON holds the right rope base where this transformers does not read it
    (transformers 5 reads `rope_parameters` and the engines follow it) is refused with the
    value the engine would serve; a field transformers cannot parse at all is refused too."""
    out = export(tmp_path, fmt)
    assert validate_export(out, fmt, DRAFT, _AUX, CTX)

    def stale_rope(cfg):
        layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    rewrite(out, edit_config=stale_rope)
    assert "parses `rope theta` as 500000.0, the drafter has 10000.0" in problems_of(out, fmt)

    def scaled_rope(cfg):
        layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
        layer["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    rewrite(out, edit_config=scaled_rope)
    assert "parses `rope type` as 'linear', the drafter has 'default'" in problems_of(out, fmt)
    if fmt != "speculators":
        rewrite(out, edit_config=lambda cfg: cfg.update(model_type="no-such-model"))
        assert "cannot parse it (ValueError" in problems_of(out, fmt)


FULL = dataclasses.replace(DRAFT, draft_vocab_size=_VOCAB)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_full_vocabulary_ships_no_map_and_a_stray_one_is_refused(tmp_path, fmt):
    """A draft vocabulary equal to the verifier's: vLLM 0.34 builds no `draft_id_to_target_id`
    and its loader raises on a `d2t` ("There is no module or parameter named ..."), SGLang
    would keep a hot-token map (no draft sampling): neither map ships, the config still names
    `draft_vocab_size` (without it SGLang would load the target's head in place of ours)."""
    out = export(tmp_path, fmt, draft=FULL)
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    report = validate_export(out, fmt, FULL, _AUX, CTX)
    assert report["full_vocab"] and report["draft_vocab_size"] == _VOCAB
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == _VOCAB
    rewrite(out, edit_tensors=lambda t: t.update(d2t=torch.zeros(_VOCAB, dtype=torch.int64),
                                                 t2d=torch.ones(_VOCAB, dtype=torch.bool)))
    with pytest.raises(ExportValidationError) as e:
        validate_export(out, fmt, FULL, _AUX, CTX)
    assert e.value.problems == [
        "`d2t` and `t2d` shipped with a full-vocabulary head: vLLM has no parameter to load "
        "`d2t` into and refuses the drafter; SGLang takes the hot-token path; ship neither "
        "(docs/engines.md \"Full vocabulary\")"]
