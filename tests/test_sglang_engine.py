"""SGLang's own code judges the commands stage 06 builds and the depth rules our config applies.

    .venv/bin/pytest tests/test_sglang_engine.py -q

`make setup-sglang` installs SGLang 0.5.23 without its GPU dependencies in `.venv-sglang`;
`tests/sglang_tools/parse_args.py` runs SGLang's argument parser and its whole resolution
pipeline (what `python -m sglang.launch_server` does before loading a model) on a command, with
the platform answered as an H100 or a B200, and `tests/sglang_tools/draft_runner.py` has SGLang's
ModelRunner code create the target's and the draft worker's attention backends for it. Nothing
here re-implements SGLang: where our rule and SGLang disagree, the test fails.
"""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
TOOLS = REPO / "tests" / "sglang_tools"
KIMI = str(REPO / "configs" / "verifiers" / "kimi-k2.5" / "config.json")

pytestmark = pytest.mark.skipif(not SGLANG_PY.is_file(),
                                reason=".venv-sglang missing: make setup-sglang")


def sglang_resolve(tmp_path: Path, cases: list[dict]) -> list[dict]:
    """SGLang's resolved server args (or its error) for each case, in one SGLang process."""
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    out = subprocess.run([str(SGLANG_PY), str(TOOLS / "parse_args.py"), "--cases", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def stage6_commands(cfg) -> list[tuple[str, list[str]]]:
    """(depth, the launch command stage 06 runs) for every SGLang depth of the config."""
    from eagle3 import bench, engines

    out = []
    for engine in cfg.bench.engines:
        if engine.name != "sglang":
            continue
        for depth in engine.parsed_depths:
            args = bench.engine_args(engine, depth, cfg.run_dir / "05_export" / "sglang",
                                     max(cfg.bench.concurrency))
            out.append((depth, engines.server_command(
                "sglang", cfg, engine.server, str(cfg.verifier_path), 8002,
                engine.server.max_model_len or 2048, args)))
    return out


@pytest.mark.parametrize("concurrency", [[1, 8, 32], [64]])
def test_kimi_sweep_commands_survive_sglang_unchanged(tmp_path, concurrency):
    """Every depth of configs/kimi-k2.5.yaml reaches SGLang's workers as we wrote it: EAGLE3,
    our export, the same steps/topk/draft tokens, enough running requests for the largest
    concurrency, on Hopper and on Blackwell (where Kimi's default attention is trtllm_mla)."""
    from eagle3.config import load_config

    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml", [f"bench.concurrency={concurrency}"])
    commands = stage6_commands(cfg)
    assert [d.label for d, _ in commands] == ["16/1/17", "10/1/11", "5/1/6", "3/1/4"]
    cases = [{"argv": cmd, "platform": p, "target_config": KIMI}
             for p in ("h100", "b200") for _, cmd in commands]
    for case, got in zip(cases, sglang_resolve(tmp_path, cases)):
        depth = commands[[c for _, c in commands].index(case["argv"])][0]
        assert "error" not in got, (case["platform"], depth.label, got)
        assert got["speculative_algorithm"] == "EAGLE3"
        assert got["speculative_draft_model_path"] == str(cfg.run_dir / "05_export" / "sglang")
        assert (got["speculative_num_steps"], got["speculative_eagle_topk"],
                got["speculative_num_draft_tokens"]) == (depth.steps, depth.topk,
                                                         depth.draft_tokens), depth.label
        assert got["max_running_requests"] >= max(concurrency)
        assert got["tp_size"] == 8 and got["reasoning_parser"] == "kimi_k2"
        assert got["chat_template"] == str(REPO / "configs/templates/kimi-k2.5-thinking.jinja")


# (depth, server extra args, platform): a spread of chains and trees around each rule.
DEPTH_CASES = [
    ("3/1/4", [], "h100"), ("16/1/17", [], "b200"), ("4/1/8", [], "h100"),
    ("1/1/3", [], "b200"),
    ("5/4/8", [], "h100"), ("3/2/9", [], "h100"), ("3/2/11", [], "h100"),
    ("3/2/12", [], "h100"), ("2/4/21", [], "h100"), ("2/4/22", [], "h100"),
    ("5/4/8", ["--attention-backend", "trtllm_mha"], "h100"),
    ("5/4/8", ["--attention-backend", "flashinfer", "--page-size", "16"], "h100"),
    ("5/4/8", ["--attention-backend", "triton", "--page-size", "16"], "h100"),
    ("5/4/8", ["--attention-backend", "trtllm_mla"], "b200"),
    ("5/4/8", ["--attention-backend", "flashmla"], "h100"),
    ("5/4/8", ["--attention-backend", "cutedsl_mla"], "b200"),
    ("5/4/8", ["--attention-backend", "tokenspeed_mla"], "b200"),
    ("5/4/8", ["--attention-backend", "fa3", "--page-size", "64"], "h100"),
    ("5/1/6", ["--attention-backend", "trtllm_mla"], "b200"),
]
SAMPLED = "--speculative-use-rejection-sampling"
DEPTH_CASES += [("3/1/4", [SAMPLED], "h100"), ("16/1/17", [SAMPLED], "b200"),
                ("5/4/8", [SAMPLED], "h100"), ("3/2/9", [SAMPLED], "h100")]
"""The same depths drafted by sampling (bench.engines[sglang].draft_sample: probabilistic, which
stage 06 writes as this flag)."""


def test_our_depth_rules_agree_with_sglang(tmp_path):
    """A depth we accept reaches SGLang's workers unchanged; one we refuse is rejected or
    rewritten by SGLang, or (too many draft tokens for the tree) fails its draft-tree code."""
    from eagle3.config import parse_depth, sglang_depth_problem

    cases = []
    for label, extra, platform in DEPTH_CASES:
        d = parse_depth(label, "x")
        cases.append({"argv": ["--model-path", "/m", "--speculative-algorithm", "EAGLE3",
                               "--speculative-draft-model-path", "/d",
                               "--speculative-num-steps", str(d.steps),
                               "--speculative-eagle-topk", str(d.topk),
                               "--speculative-num-draft-tokens", str(d.draft_tokens), *extra],
                      "platform": platform, "target_config": KIMI})
    answers = sglang_resolve(tmp_path, cases)
    depths = [parse_depth(label, "x") for label, _, _ in DEPTH_CASES]
    fits = trees_fit([d for d in depths if d.topk > 1])
    for (label, extra, platform), d, got in zip(DEPTH_CASES, depths, answers):
        sample = "probabilistic" if SAMPLED in extra else "greedy"
        ours = sglang_depth_problem(d, [a for a in extra if a != SAMPLED], sample)
        kept = "error" not in got and (got["speculative_num_steps"], got["speculative_eagle_topk"],
                                       got["speculative_num_draft_tokens"]) == (
            d.steps, d.topk, d.draft_tokens)
        runs = fits[(d.steps, d.topk, d.draft_tokens)] if d.topk > 1 else True
        assert (ours is None) == (kept and runs), (label, extra, platform, ours, got)


def trees_fit(depths) -> dict[tuple[int, int, int], bool]:
    """Whether SGLang's draft-tree selection (speculative/eagle_utils.organize_draft_results,
    which keeps the draft_tokens - 1 best of the tree's candidates) runs for each tree."""
    trees = sorted({(d.steps, d.topk, d.draft_tokens) for d in depths})
    script = f"""
import json, sys; sys.path.insert(0, {str(TOOLS)!r})
import sglang_cpu; sglang_cpu.install_torchvision_stub()
import torch
from sglang.srt.speculative.eagle_utils import organize_draft_results
out = []
for s, k, n in {trees!r}:
    scores = [torch.rand(1, 1, k)] + [torch.rand(1, k, k) for _ in range(s - 1)]
    tokens = [torch.randint(0, 100, (1, k))] + [torch.randint(0, 100, (1, k * k))
                                                for _ in range(s - 1)]
    parents = [torch.arange(-1, k).unsqueeze(0)] + [torch.arange(k * k).unsqueeze(0)
                                                    for _ in range(s - 1)]
    try:
        organize_draft_results(scores, tokens, parents, n)
        out.append(True)
    except RuntimeError:
        out.append(False)
print(json.dumps(out))
"""
    out = subprocess.run([str(SGLANG_PY), "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(zip(trees, json.loads(out.stdout.strip().splitlines()[-1])))


# ---------------------------------------------------------------------------------------------
# SGLang's model-runner code judges the drafter's attention backend: with "backends": true,
# parse_args.py hands the resolved command to tests/sglang_tools/draft_runner.py, which builds
# SGLang's ModelRunner for the target and for the EAGLE-3 draft worker up to their first GPU call
# and lets SGLang's own resolution and backend registry create each runner's attention backend
# (stopping where the chosen backend object would allocate on the GPU).


def kimi_drafter_config(tmp_path: Path, cfg) -> str:
    """The config.json stage 05 writes into the sglang export of cfg's drafter (eagle3.formats),
    for the Kimi-K2.5 shape of `plan.verifier_config` (the verifier itself is not here)."""
    import dataclasses

    from eagle3.config import read_verifier_info
    from eagle3.formats import ExportContext, get_format
    from eagle3.train import draft_model_config

    info = read_verifier_info(dataclasses.replace(cfg.verifier, path=cfg.plan.verifier_config))
    draft = draft_model_config(cfg, info.vocab_size, cfg.vocab.size_for(info.vocab_size), info)
    config = get_format("sglang").config(draft, list(info.aux_layer_ids),
                                         ExportContext(str(cfg.verifier_path), info.architecture))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "kimi-drafter-config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_kimi_drafter_gets_an_attention_backend_it_can_run(tmp_path):
    """On Blackwell SGLang gives Kimi's MLA target trtllm_mla, and a draft worker with no backend
    of its own inherits the target's, whose factory refuses a model that is not MLA. Every depth
    of configs/kimi-k2.5.yaml, and the SGLang command of the export's model card, must give our
    Llama-layer drafter a backend it runs on (SGLang's own runner code decides), on Blackwell and
    Hopper, with the target keeping trtllm_mla on Blackwell."""
    import shlex

    from eagle3.config import load_config
    from eagle3.model_card import serve_commands

    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    drafter = kimi_drafter_config(tmp_path, cfg)
    card = serve_commands("sglang", cfg.run_dir / "05_export" / "sglang", {},
                          str(cfg.verifier_path), True, mla=True)["sglang"]
    commands = [cmd for _, cmd in stage6_commands(cfg)] + [shlex.split(card)]
    cases = [{"argv": cmd, "platform": p, "target_config": KIMI, "draft_config": drafter,
              "backends": True} for p in ("b200", "h100") for cmd in commands]
    for case, got in zip(cases, sglang_resolve(tmp_path, cases)):
        assert "error" not in got, (case["platform"], got)
        draft, target = got["backends"]["draft"], got["backends"]["target"]
        assert draft == {"backend": "flashinfer", "mla_model": False,
                         "class": "FlashInferAttnBackend"}, (case["platform"], draft)
        if case["platform"] == "b200":
            assert target == {"backend": "trtllm_mla", "mla_model": True,
                              "class": "TRTLLMMLABackend"}, target


def test_kimi_mla_drafter_shares_the_targets_mla_backend(tmp_path):
    """configs/kimi-k2.5-mla.yaml: an MLA drafter (Eagle3DeepseekV2ForCausalLM, in SGLang's MLA
    list) needs no backend of its own. Every depth of its sweep runs the drafter on the target's
    trtllm_mla on a B200 (SGLang's own runner code creates it), drafting by rejection sampling
    as its full vocabulary allows, and the plan agrees."""
    from eagle3.config import load_config, sglang_engine_problem

    cfg = load_config(REPO / "configs" / "kimi-k2.5-mla.yaml")
    assert sglang_engine_problem(cfg, True) is None
    drafter = kimi_drafter_config(tmp_path, cfg)
    commands = stage6_commands(cfg)
    assert all(SAMPLED in cmd for _, cmd in commands)
    cases = [{"argv": cmd, "platform": "b200", "target_config": KIMI, "draft_config": drafter,
              "backends": True} for _, cmd in commands]
    for (depth, _), got in zip(commands, sglang_resolve(tmp_path, cases)):
        assert "error" not in got, (depth.label, got)
        mla = {"backend": "trtllm_mla", "mla_model": True, "class": "TRTLLMMLABackend"}
        assert got["backends"]["draft"] == mla and got["backends"]["target"] == mla, got


# (server extra args, target): the drafter's backend on a B200, around our rule.
DRAFT_BACKEND_CASES = [
    ([], "kimi"), ([], "llama"),
    (["--speculative-draft-attention-backend", "flashinfer"], "kimi"),
    (["--speculative-draft-attention-backend", "triton"], "kimi"),
    (["--speculative-draft-attention-backend", "trtllm_mla"], "kimi"),
    (["--attention-backend", "flashinfer"], "kimi"),   # the trees' rule serves the drafter too
    (["--attention-backend", "triton"], "kimi"),
    (["--attention-backend", "trtllm_mla"], "kimi"),
    (["--attention-backend", "cutedsl_mla"], "kimi"),
    (["--prefill-attention-backend", "flashinfer", "--decode-attention-backend", "trtllm_mla"],
     "kimi"),
    (["--attention-backend", "trtllm_mla", "--speculative-draft-attention-backend", "flashinfer"],
     "kimi"),
]


def test_our_draft_backend_rule_agrees_with_sglang(tmp_path):
    """eagle3.config.sglang_draft_backend_problem refuses exactly the server args with which
    SGLang's runner code cannot create the drafter's attention backend on a B200 (where an MLA
    verifier's default is trtllm_mla): for our Llama-layer drafter, and for an MLA drafter
    (configs/kimi-k2.5-mla.yaml), which SGLang treats as an MLA model on every backend."""
    from eagle3.config import load_config, sglang_draft_backend_problem

    kimi = kimi_drafter_config(tmp_path / "mha", load_config(REPO / "configs" / "kimi-k2.5.yaml"))
    kimi_mla = kimi_drafter_config(tmp_path / "mla",
                                   load_config(REPO / "configs" / "kimi-k2.5-mla.yaml"))
    assert "Eagle3DeepseekV2ForCausalLM" in Path(kimi_mla).read_text()
    configs = {"kimi": (KIMI, kimi), "llama": ("llama", "eagle3"), "kimi-mla": (KIMI, kimi_mla)}
    grid = DRAFT_BACKEND_CASES + [(extra, "kimi-mla") for extra, target in DRAFT_BACKEND_CASES
                                  if target == "kimi"]
    cases = [{"argv": ["--model-path", "/m", "--speculative-algorithm", "EAGLE3",
                       "--speculative-draft-model-path", "/d", "--speculative-num-steps", "3",
                       "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                       *extra],
              "platform": "b200", "target_config": configs[target][0],
              "draft_config": configs[target][1], "backends": True}
             for extra, target in grid]
    for (extra, target), got in zip(grid, sglang_resolve(tmp_path, cases)):
        assert "error" not in got, (extra, target, got)
        ours = sglang_draft_backend_problem(extra, mla_verifier=target != "llama",
                                            mla_drafter=target == "kimi-mla")
        runs = "class" in got["backends"]["draft"]
        assert (ours is None) == runs, (extra, target, ours, got["backends"])
        if target == "kimi-mla":
            assert got["backends"]["draft"]["mla_model"] is True


# ---------------------------------------------------------------------------------------------
# SGLang's loader judges our SGLang exports: tests/sglang_tools/load_weights.py builds SGLang's
# own LlamaForCausalLMEagle3 on CPU (a one-process gloo group stands in for its distributed
# set-up), fills every parameter with NaN, runs SGLang's loader on the export, and calls
# SGLang's own aux-id resolution and `set_eagle3_layers_to_capture` on tiny real Llama and
# DeepSeek-V3 targets.


def sglang_load(tmp_path: Path, export: Path, aux: list[int], layers: int = 8) -> dict:
    out = tmp_path / f"load-{export.parent.name}-{export.name}.json"
    run = subprocess.run([str(SGLANG_PY), str(TOOLS / "load_weights.py"), str(export),
                          "--target-layers", str(layers), "--aux", ",".join(map(str, aux)),
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def fake_verifier(tmp_path: Path, arch: str, vocab: int = 1000, hidden: int = 64) -> Path:
    """A verifier config only (the converter reads no verifier weight when the drafter ships no
    embedding)."""
    d = tmp_path / f"verifier-{arch}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": 8, "vocab_size": vocab, "num_attention_heads": 4,
        "intermediate_size": 96}))
    return d


def exported(tmp_path: Path, arch: str, internal: list[int], *extra: str,
             eagle31: bool = False, full_vocab: bool = False,
             mla: dict | None = None) -> tuple[Path, dict]:
    """A random drafter trained (say) on HF layers `internal` of a verifier of `arch`, written in
    the vLLM layout and converted by `05_fix_keys.py --from` (bf16, as served: SGLang loads a
    float32 config as float16 under `--dtype auto`)."""
    import torch
    from test_convert import convert_dir, draft_config

    from eagle3.formats import ExportContext, write_export
    from eagle3.model import Eagle3DraftModel

    # a full head's rows are a multiple of 64 here, as SGLang pads ParallelLMHead (and as
    # 49,152 and 163,840 are), so the check can compare every row
    vocab = 1024 if full_vocab else 1000
    verifier = fake_verifier(tmp_path, arch, vocab)
    torch.manual_seed(0)
    import dataclasses
    cfg = dataclasses.replace(draft_config(vocab), fc_norm=eagle31, norm_output=eagle31,
                              draft_vocab_size=vocab if full_vocab else 512)
    if mla:  # MLA fields (attention="mla", ranks, head dims, rope_scaling)
        cfg = dataclasses.replace(cfg, num_key_value_heads=cfg.num_attention_heads, **mla)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        if not full_vocab:
            chosen = torch.randperm(vocab)[:512].sort().values
            model.d2t.copy_(chosen - torch.arange(512))
            model.t2d.zero_()
            model.t2d[chosen] = True
    src = tmp_path / "src"
    src.mkdir()
    write_export(src, "vllm", model.trainable_state_dict(), model.cfg, internal,
                 ExportContext(str(verifier), arch))
    report = convert_dir(src, tmp_path / "out", "--verifier", str(verifier), "--dtype",
                         "bfloat16", *extra)
    return tmp_path / "out", report


def assert_loaded_whole(result: dict) -> None:
    """Every parameter SGLang has came from the checkpoint (the embedding from the verifier),
    and SGLang's hot-token map is arange + d2t."""
    for row in result["params"]:
        if row["param"] == "model.embed_tokens.weight":
            continue
        assert row["status"] == "written" and row["value"] == "== checkpoint", row
    assert result["embed_after_set_embed"] == "replaced by the target's embedding (set_embed)"
    assert result["hot_token_id"]["equals_arange_plus_d2t"] is True
    assert result["ignored_checkpoint_keys"] == ["d2t", "t2d"]


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_sglang_loads_both_key_layouts_for_a_llama_verifier(tmp_path, fmt):
    """Our SGLang export (midlayer.*) and our vLLM export (layers.0.*, which SGLang 0.5.23 maps)
    load whole; the SGLang export's ids capture the trained layers on a Llama target."""
    out, report = exported(tmp_path, "LlamaForCausalLM", [2, 4, 6])
    written = report["formats"]["sglang"]["aux_layer_ids_written"]
    result = sglang_load(tmp_path, out / fmt, written)
    assert_loaded_whole(result)
    if fmt == "sglang":
        assert written == [1, 3, 5]
        assert result["aux"][0]["llama"] == [2, 4, 6]


def test_sglang_loads_an_eagle31_drafter_whole(tmp_path):
    """EAGLE-3.1 norms: SGLang builds `fc_norm.<i>` from the config's `fc_norm` flag and fills
    each from our export's tensor of that name (nothing left unwritten, nothing skipped)."""
    out, report = exported(tmp_path, "LlamaForCausalLM", [2, 4, 6], eagle31=True)
    assert report["formats"]["sglang"]["fc_norm"] and report["formats"]["sglang"]["norm_output"]
    config = json.loads((out / "sglang" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    result = sglang_load(tmp_path, out / "sglang", [1, 3, 5])
    assert_loaded_whole(result)
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= {r["param"]
                                                              for r in result["params"]}


def test_sglang_loads_a_full_vocabulary_drafter_with_its_own_head(tmp_path):
    """`vocab.draft_vocab_size: full`: no d2t/t2d ships, so SGLang keeps no hot-token map (the
    one thing its draft worker checks before sampling drafts, eagle_worker_v2.py) and, as the
    config names the draft vocabulary, loads our trained lm_head rather than the target's."""
    out, report = exported(tmp_path, "LlamaForCausalLM", [2, 4, 6], full_vocab=True)
    assert report["formats"]["sglang"]["full_vocab"] is True
    result = sglang_load(tmp_path, out / "sglang", [1, 3, 5])
    for row in result["params"]:
        if row["param"] != "model.embed_tokens.weight":
            assert row["status"] == "written" and row["value"] == "== checkpoint", row
    assert "lm_head.weight" in {r["param"] for r in result["params"]}
    assert result["hot_token_id"] is None and result["load_lm_head_from_target"] is False
    assert result["ignored_checkpoint_keys"] == [] and "d2t" not in result["checkpoint_keys"]


# Kimi-K2.5's attention, scaled down: q_lora, kv_lora, nope/rope/v head dims and its YaRN x64
KIMI_LIKE_MLA = {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 32,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                 "head_dim": 24, "max_position_embeddings": 262144,
                 "rope_scaling": {"type": "yarn", "factor": 64.0,
                                  "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.mark.parametrize("full_vocab", [False, True], ids=["reduced-vocab", "full-vocab-eagle31"])
def test_sglang_loads_an_mla_drafter_whole_with_our_scale_and_rope(tmp_path, full_vocab):
    """`draft.attention: mla`: SGLang's own Eagle3DeepseekV2ForCausalLM (kimi_k25_eagle3.py)
    fills every parameter from our export (q_a_proj and kv_a_proj_with_mqa fused), takes d2t as
    its hot-token map, and computes the softmax scale and the YaRN rope table our training used
    (the table to bf16 rounding: SGLang stores it in the serving dtype). The full-vocabulary case
    carries EAGLE-3.1's norms too, as lightseekorg's kimi-k2.6-eagle3.1-mla does."""
    from eagle3.model import DraftModelConfig
    out, report = exported(tmp_path, "DeepseekV3ForCausalLM", [2, 4, 6], "--formats",
                           "sglang,vllm", full_vocab=full_vocab, mla=KIMI_LIKE_MLA,
                           eagle31=full_vocab)
    record = report["formats"]["sglang"]
    config = json.loads((out / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    result = sglang_load(tmp_path, out / "sglang", record["aux_layer_ids_written"])
    assert result["model_class"].endswith("Eagle3DeepseekV2ForCausalLM"), result["model_class"]
    for row in result["params"]:
        if row["param"] != "model.embed_tokens.weight":
            assert row["status"] == "written" and row["value"] == "== checkpoint", row
    assert any(r["param"].endswith("fused_qkv_a_proj_with_mqa.weight") for r in result["params"])
    norms = {f"model.fc_norm.{i}.weight" for i in range(3)}
    assert (norms <= {r["param"] for r in result["params"]}) == full_vocab
    if full_vocab:
        assert result["hot_token_id"] is None and result["ignored_checkpoint_keys"] == []
    else:
        assert result["hot_token_id"]["equals_arange_plus_d2t"] is True
        assert result["ignored_checkpoint_keys"] == ["d2t", "t2d"]
    from test_convert import draft_config
    import dataclasses
    vocab = 1024 if full_vocab else 1000
    cfg: DraftModelConfig = dataclasses.replace(draft_config(vocab), num_key_value_heads=4,
                                                **KIMI_LIKE_MLA)
    assert_sglang_computes_our_attention(result["attention"], cfg)


def assert_sglang_computes_our_attention(att: dict, cfg) -> None:
    """SGLang's draft layer has our softmax scale and, to bf16 rounding (SGLang stores the
    table in the serving dtype), our rope table: DeepSeek's interleaved rotary embedding for an
    MLA layer, Llama's half-split one otherwise."""
    import torch

    from eagle3.model import Attention, MLAttention, rope_cos_sin
    mla = cfg.attention == "mla"
    assert att["rotary_class"] == ("DeepseekScalingRotaryEmbedding" if mla else
                                   "YaRNScalingRotaryEmbedding" if cfg.rope_scaling else
                                   "RotaryEmbedding"), att["rotary_class"]
    assert att["neox_style"] is not mla
    layer = (MLAttention if mla else Attention)(cfg, cfg.hidden_size)
    assert att["scaling"] == pytest.approx(layer.scale, rel=1e-12)
    positions = torch.tensor(att["positions"][:len(att["cos_sin_cache"])])
    cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta, torch.float32,
                            cfg.rope_scaling)
    half = cfg.rope_dim // 2  # SGLang's table row: cos then sin of each frequency
    ours = torch.cat([cos[:, :half], sin[:, :half]], -1)
    assert torch.allclose(torch.tensor(att["cos_sin_cache"]), ours, atol=4e-3)


def test_lightseek_yarn_llama_drafter_through_from_loads_whole_in_sglang(tmp_path):
    """lightseekorg's Llama-layer Kimi drafter (kimi-k2.5-eagle3: `midlayer.*`, Kimi's YaRN,
    full vocabulary) converted by `--from`: our exports carry its rope scaling, and SGLang's
    own LlamaForCausalLMEagle3 takes every parameter and turns the YaRN rope table and softmax
    scale our Llama layer trains with."""
    import dataclasses

    import torch
    from test_convert import aq_medai_dir, convert_dir, draft_config

    from eagle3.model import Eagle3DraftModel
    yarn = KIMI_LIKE_MLA["rope_scaling"]
    cfg = dataclasses.replace(draft_config(1024), draft_vocab_size=1024, rope_scaling=yarn,
                              max_position_embeddings=262144)
    torch.manual_seed(4)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    src = aq_medai_dir(tmp_path / "lightseek", model, aux=[1, 3, 5], embed=False,
                       rope_scaling=yarn, torch_dtype="bfloat16")
    verifier = fake_verifier(tmp_path, "DeepseekV3ForCausalLM", 1024)
    report = convert_dir(src, tmp_path / "out", "--verifier", str(verifier), "--dtype",
                         "bfloat16")
    assert sorted(report["formats"]) == ["sglang", "speculators", "vllm"]
    for fmt in report["formats"]:
        written = json.loads((tmp_path / "out" / fmt / "config.json").read_text())
        layer = written.get("transformer_layer_config", written)
        assert layer["rope_scaling"] == yarn and layer["rope_parameters"]["rope_type"] == "yarn"
    record = report["formats"]["sglang"]
    result = sglang_load(tmp_path, tmp_path / "out" / "sglang", record["aux_layer_ids_written"])
    for row in result["params"]:
        if row["param"] != "model.embed_tokens.weight":
            assert row["status"] == "written" and row["value"] == "== checkpoint", row
    assert result["hot_token_id"] is None
    assert_sglang_computes_our_attention(result["attention"], cfg)


def test_lightseek_mla_drafter_through_from_loads_whole_in_sglang(tmp_path):
    """lightseekorg's MLA layout (midlayer.*, kimi_k2 config, full vocabulary, aux ids written
    for SGLang's DeepSeek target) converted by `05_fix_keys.py --from`: SGLang's own loader
    takes every parameter of the source and of our export, which captures the same layers."""
    import dataclasses

    import torch
    from test_convert import convert_dir, draft_config, lightseek_mla_dir

    from eagle3.model import Eagle3DraftModel
    torch.manual_seed(3)
    cfg = dataclasses.replace(draft_config(1024), num_key_value_heads=4, draft_vocab_size=1024,
                              **KIMI_LIKE_MLA)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    src = lightseek_mla_dir(tmp_path / "lightseek", model, aux=[1, 3, 5])
    verifier = fake_verifier(tmp_path, "DeepseekV3ForCausalLM", 1024)
    report = convert_dir(src, tmp_path / "out", "--verifier", str(verifier), "--dtype",
                         "bfloat16")
    assert sorted(report["formats"]) == ["sglang", "vllm"]  # speculators has no MLA layer
    record = report["formats"]["sglang"]
    assert record["attention"] == "mla" and record["full_vocab"] is True
    loaded = {}
    for name, d, aux in [("source", src, [1, 3, 5]),
                         ("export", tmp_path / "out" / "sglang", record["aux_layer_ids_written"])]:
        loaded[name] = result = sglang_load(tmp_path, d, aux)
        for row in result["params"]:
            if row["param"] != "model.embed_tokens.weight":
                assert row["status"] == "written" and row["value"] == "== checkpoint", (name, row)
        assert result["hot_token_id"] is None and result["ignored_checkpoint_keys"] == []
    assert loaded["source"]["aux"] == loaded["export"]["aux"]
    assert loaded["source"]["attention"] == loaded["export"]["attention"]


@pytest.mark.parametrize("internal,rule,valid", [
    ([2, 4, 6], "auto", ["pre-25454", "post-25454"]),   # written [1,3,5]: both SGLangs
    ([3, 5, 6], "auto", ["post-25454"]),                 # written as is: no robust choice
    ([3, 5, 6], "pre-25454", ["pre-25454"]),             # written [2,4,5] for old SGLang
])
def test_sglang_captures_the_trained_layers_of_a_deepseek_family_verifier(tmp_path, internal,
                                                                          rule, valid):
    """DeepSeek-V3 / Kimi targets add one only when the first id is 1 (SGLang >= PR #25454);
    SGLang before it added one always, as its Llama target still does, so that target's capture
    stands in for old SGLang's DeepSeek code."""
    out, report = exported(tmp_path, "DeepseekV3ForCausalLM", internal, "--formats", "sglang",
                           "--sglang-aux-ids", rule)
    record = report["formats"]["sglang"]
    assert record["aux_ids_valid_for"] == [f"sglang {v}" for v in valid]
    result = sglang_load(tmp_path, out / "sglang", record["aux_layer_ids_written"])
    assert_loaded_whole(result)
    captured = {"post-25454": result["aux"][0]["deepseek_v3"],
                "pre-25454": result["aux"][0]["llama"]}
    for version in valid:
        assert captured[version] == internal, (version, captured)
    for version in set(captured) - set(valid):
        assert captured[version] != internal
    assert "real DeepseekV3ForCausalLM" in result["deepseek_target"]
