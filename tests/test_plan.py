"""The plan's tokenizer preflight: a template that drops a thinking verifier's reasoning fails,
one that renders it passes, and a template with no notion of reasoning is not a false alarm.

    .venv/bin/pytest tests/test_plan.py -q
"""

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import REPO, make_config
from eagle3.plan import _tokenizer_verdict

RENDERS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>"
           "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")
DROPS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content and false %}"
         "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize("template, ok", [(None, None), (RENDERS, True), (DROPS, False)])
def test_tokenizer_verdict_tells_dropped_reasoning_from_none(tmp_path, tiny_verifier, template,
                                                             ok):
    verifier = {}
    if template:
        (tmp_path / "t.jinja").write_text(template)
        verifier["chat_template"] = str(tmp_path / "t.jinja")
    cfg = make_config(tmp_path, tiny_verifier, verifier=verifier)
    verdict = _tokenizer_verdict(cfg)
    assert verdict.ok is ok, verdict.detail
    if ok is False:
        assert "verifier.chat_template" in verdict.detail


FIT = {"per_token_step": {"const": 1000.0, "draft_vocab": 10.0, "hidden": 40.0,
                          "intermediate": 8.0, "attention": 20.0}, "transient_bytes": 0}


@pytest.fixture
def memory_fit(tmp_path, monkeypatch):
    import json

    import eagle3.plan as plan
    fit = {"measured": "a test fit", "plain": FIT,
           "checkpointed": {**FIT, "per_token_step": {k: v / 4 for k, v in
                                                      FIT["per_token_step"].items()}}}
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    monkeypatch.setattr(plan, "MEMORY_FIT", tmp_path / "fit.json")


def test_training_memory_adds_activations_and_names_what_fits(tmp_path, tiny_verifier,
                                                              memory_fit):
    """Per-GPU peak = model states + the fitted activations of one micro-batch; above 90% of
    plan.gpu_memory_gb the verdict fails and names the largest batch_tokens that fits, and
    checkpointing or FSDP where they would help."""
    from eagle3.plan import memory_lines, memory_verdict, training_memory

    def plan(**train):
        cfg = make_config(tmp_path, tiny_verifier, train={"batch_tokens": 4096, **train},
                          plan={"gpu_memory_gb": 0.05})
        return cfg, training_memory(cfg, cfg.verifier_info)

    cfg, mem = plan()
    small_cfg, small = plan(batch_tokens=1024)
    ckpt_cfg, ckpt = plan(activation_checkpointing=True)
    assert mem["peak"]["ddp"] == mem["ddp"] + mem["activations"]
    assert 3.9 < mem["activations"] / small["activations"] <= 4.0  # linear in tokens
    assert ckpt["activations"] < mem["activations"] / 2 and ckpt["checkpointing"]
    assert ckpt["activations_other"] == mem["activations"]
    verdict = memory_verdict(cfg, mem)
    budget = 0.9 * 0.05e9
    assert mem["ddp"] < budget < mem["peak"]["ddp"], (mem["ddp"], mem["peak"])  # the case
    assert verdict.ok is False
    fits = mem["max_batch_tokens"]["ddp"]
    assert 0 < fits < 4096 and f"train.batch_tokens<={fits}" in verdict.detail
    assert "train.activation_checkpointing=true" in verdict.detail
    _, at_fit = plan(batch_tokens=fits)
    assert at_fit["peak"]["ddp"] <= budget
    assert memory_verdict(ckpt_cfg, ckpt).ok is (ckpt["peak"]["ddp"] <= budget)
    assert any("peak per GPU" in line for line in memory_lines(cfg, mem))


def test_memory_verdict_is_a_skip_without_a_gpu_size(tmp_path, tiny_verifier, memory_fit):
    from eagle3.plan import memory_verdict, training_memory
    cfg = make_config(tmp_path, tiny_verifier)
    assert memory_verdict(cfg, training_memory(cfg, cfg.verifier_info)).ok is None


def test_a_plan_with_a_failed_check_exits_2(tmp_path, tiny_verifier, memory_fit, capsys):
    """A script running `python -m eagle3.plan` must not read [FAIL] lines as a pass."""
    from eagle3.plan import main
    cfg = make_config(tmp_path, tiny_verifier, train={"batch_tokens": 4096})
    assert main([cfg.source, "plan.gpu_memory_gb=0.05"]) == 2
    out = capsys.readouterr()
    assert "[FAIL]" in out.out and "error: the plan fails 1 check(s)" in out.err
    assert main([cfg.source]) == 0


def test_the_plan_counts_verifier_loads_and_names_untrained_draft_positions():
    """The Kimi config: one load each for stages 01 and 02, one per served depth and baseline
    in stage 06; its 16-deep SGLang depth serves positions TTT 7 never trained."""
    from eagle3.config import load_config
    from eagle3.bench import served_beyond_trained
    from eagle3.plan import verifier_loads
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.5.yaml")
    depths = sum(len(e.parsed_depths) + e.serves_baseline for e in cfg.bench.engines)
    assert verifier_loads(cfg) == {"01": 1, "02": 1, "04": 0, "06": depths}
    assert "draft positions 8-16 were never trained" in served_beyond_trained(cfg)
    external = load_config(Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.5.yaml",
                           ["generate.server_urls=[http://n1:8000]", "train.ttt_steps=16"])
    assert verifier_loads(external)["01"] == 0 and served_beyond_trained(external) is None


def test_remote_code_this_transformers_lacks_fails_the_preflight(tmp_path, kimi_verifier):
    """Older Kimi tokenizer snapshots import `bytes_to_unicode` from gpt2's tokenizer module,
    which transformers 5 no longer has: the plan's tokenizer check fails and names the import.
    The vllm backend's final-norm check builds the verifier's decoder through its code too."""
    import shutil

    from eagle3.plan import _engine_tokenizer_verdict, _final_norm_verdict

    verifier = tmp_path / "kimi"
    shutil.copytree(kimi_verifier, verifier)
    cfg = make_config(tmp_path, verifier, verifier={"trust_remote_code": True},
                      hidden_states={"backend": "vllm"})
    assert _tokenizer_verdict(cfg).ok, _tokenizer_verdict(cfg).detail
    # The engines load the tokenizer with their own transformers: checked in their Python.
    import subprocess
    sglang_python = REPO / ".venv-sglang" / "bin" / "python"
    for python in [sys.executable] + ([str(sglang_python)] if sglang_python.exists() else []):
        engine = _engine_tokenizer_verdict(cfg, "sglang", python)
        has_tiktoken = subprocess.run([python, "-c", "import tiktoken"]).returncode == 0
        if has_tiktoken:
            assert engine.ok and "TikTokenTokenizer under transformers" in engine.detail, \
                engine.detail
        else:  # the tests' SGLang environment has no tiktoken: that Python could not serve Kimi
            assert engine.ok is False and "tiktoken" in engine.detail and \
                f"install them with {python} -m pip" in engine.detail, engine.detail
    good = _final_norm_verdict(cfg)
    assert good.ok, good.detail
    code = verifier / "tokenization_kimi.py"
    older = code.read_text().replace("from transformers.convert_slow_tokenizer import",
                                     "from transformers.models.gpt2.tokenization_gpt2 import")
    assert older != code.read_text()
    code.write_text(older)
    verdict = _tokenizer_verdict(cfg)
    assert verdict.ok is False and "bytes_to_unicode" in verdict.detail, verdict.detail
    engine = _engine_tokenizer_verdict(cfg, "vllm", sys.executable)
    assert engine.ok is False and "bytes_to_unicode" in engine.detail, engine.detail
    config = json.loads((verifier / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = "many"
    (verifier / "config.json").write_text(json.dumps(config))
    broken = _final_norm_verdict(cfg)
    assert broken.ok is False, broken.detail


def test_an_engine_command_names_the_python_it_runs_in(tmp_path, monkeypatch):
    """`vllm serve` is a console script: its #! line names the environment's Python, where the
    tokenizer check runs."""
    from eagle3.config import ServerConfig
    from eagle3.plan import engine_python
    script = tmp_path / "bin" / "fake-engine"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nprint('serving')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    assert engine_python(ServerConfig(command=["fake-engine", "serve", "{model}"])) == \
        sys.executable
    assert engine_python(ServerConfig(python="/opt/sglang/bin/python")) == "/opt/sglang/bin/python"
    assert engine_python(ServerConfig(command=["no-such-engine-here"])) is None


def test_the_plan_weighs_storing_against_streaming():
    """Store pays the disk and one verifier pass, stream a pass per epoch: with the disk, more
    than one epoch makes storing cheaper; without it, or at one epoch, streaming is."""
    from eagle3.config import load_config
    from eagle3.plan import store_or_stream, verifier_facts, verifier_loads
    kimi = Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.5.yaml"
    cfg = load_config(kimi, ["plan.extract_tok_s=2000", "train.epochs=3"])
    info, _ = verifier_facts(cfg)
    tokens, stored = 72e6, 4.0e12
    roomy = store_or_stream(cfg, info, tokens, stored, (10 ** 14, Path("/big")))
    assert roomy["cheaper"] == "store"
    assert "it saves 20.0 verifier hours for 4.000 TB" in "\n".join(roomy["lines"])
    assert "30.0 verifier hours" in roomy["lines"][2] and "10.0 verifier hours" in \
        roomy["lines"][1]
    assert roomy["disk"]["stream"] < 1e10
    small = store_or_stream(cfg, info, 72e4, 4.0e10, (10 ** 14, Path("/big")))["lines"]
    assert "40.000 GB on disk, 6.0 verifier minutes" in small[1]  # a demo's scale reads
    full = store_or_stream(cfg, info, tokens, stored, (10 ** 12, Path("/small")))
    assert full["cheaper"] == "stream" and "1.00 TB is free at /small" in full["lines"][-1]
    once = load_config(kimi, ["train.epochs=1"])
    assert store_or_stream(once, info, tokens, stored, (10 ** 14, Path("/big")))["cheaper"] == \
        "stream"
    streamed = load_config(kimi, ["hidden_states.mode=stream"])
    assert verifier_loads(streamed)["04"] == 1
    assert verifier_loads(load_config(kimi, ["hidden_states.mode=stream",
                                             "hidden_states.server_urls=[http://n2:8000]"]))["04"] == 0


def test_after_stage_01_the_plan_uses_what_it_measured(tmp_path, tiny_verifier):
    """Stage 02's disk and the store / stream choice follow the samples stage 01 really made,
    not the answer-length assumption; a stage 01 made with another config is not used."""
    from conftest import run_stage
    from eagle3.config import load_config
    from eagle3.plan import data_estimate
    from eagle3.runs import Stage

    cfg = make_config(tmp_path, tiny_verifier, data={"num_samples": 6, "max_user_turns": 1})
    assumed = data_estimate(cfg)
    assert assumed["answer_source"] == "0.5 x max_new_tokens"
    run_stage("01_generate_data.py", cfg, check=True)
    counts = Stage(cfg, 1).manifest()["counts"]
    measured = data_estimate(cfg)
    assert measured["tokens"] == counts["tokens"] != assumed["tokens"]
    assert measured["generated_tokens"] == counts["generated_tokens"]
    assert measured["answer_source"] == "measured by stage 01"
    other = load_config(cfg.source, ["generate.max_new_tokens=8"])
    assert data_estimate(other)["answer_source"] == "0.5 x max_new_tokens"
