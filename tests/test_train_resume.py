"""Stage 04 end to end on the tiny verifier: kill -9 mid-training, rerun, same result."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_config, run_stage
from eagle3.checkpoint import read_pointer, step_dirs


def find_latest(train_dir: Path) -> Path:
    return step_dirs(train_dir)[-1][1]
from eagle3.runs import Stage

STAGE_SCRIPTS = ["01_generate_data.py", "02_extract_hidden_states.py", "03_build_vocab_map.py"]


def run_script(script, cfg, *extra, check=True):
    return run_stage(script, cfg, *extra, check=check)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier):
    """Stages 01-03 on the tiny verifier, shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = make_config(tmp, tiny_verifier,
                      data={"num_samples": 12, "max_user_turns": 1, "max_seq_len": 96},
                      train={"epochs": 6, "batch_tokens": 96, "checkpoint_every": 2,
                             "keep": 2, "ttt_steps": 3})
    for script in STAGE_SCRIPTS:
        run_script(script, cfg)
    return cfg


def copy_run(cfg, dest: Path):
    """A second run directory holding the same stages 01-03 (and a config pointing at it)."""
    from dataclasses import replace
    import yaml
    shutil.copytree(cfg.run_dir, dest / "runs" / cfg.run.name,
                    ignore=shutil.ignore_patterns("04_train*"))
    raw = yaml.safe_load(Path(cfg.source).read_text())
    raw["run"]["dir"] = str(dest / "runs")
    (dest / "config.yaml").write_text(yaml.safe_dump(raw))
    return replace(cfg, run=replace(cfg.run, dir=str(dest / "runs")),
                   source=str(dest / "config.yaml"))


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Poll until `path` exists (a checkpoint became visible) while `proc` keeps running."""
    deadline = time.time() + timeout
    while not path.is_dir():
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.005)


def test_kill9_then_resume_equals_uninterrupted(prepared, tmp_path):
    a = copy_run(prepared, tmp_path / "a")
    b = copy_run(prepared, tmp_path / "b")
    run_script("04_train.py", a)
    manifest = Stage(a, 4).manifest()
    assert manifest["counts"]["steps"] >= 8, "the test needs a run of several checkpoints"

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "04_train.py", b.source], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "b.log", "w"))
    train_dir = Stage(b, 4).dir
    wait_for(train_dir / "step-2", proc, tmp_path / "b.log")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not Stage(b, 4).is_done(), "killed before the end: no manifest may exist"
    killed_at = find_latest(train_dir)
    assert killed_at is not None

    out = run_script("04_train.py", b)
    assert "resumed from step-" in out.stdout + out.stderr
    latest_a, latest_b = find_latest(Stage(a, 4).dir), find_latest(train_dir)
    assert latest_a.name == latest_b.name
    wa, wb = load_file(latest_a / "model.safetensors"), load_file(latest_b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    oa = torch.load(latest_a / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    ob = torch.load(latest_b / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    for i in oa:
        assert torch.equal(oa[i]["exp_avg"], ob[i]["exp_avg"])
        assert torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"])
    ma = (Stage(a, 4).dir / "metrics.jsonl").read_text()
    mb = (train_dir / "metrics.jsonl").read_text()
    assert ma == mb

    # Rerunning a finished stage does nothing.
    again = run_script("04_train.py", b)
    assert "already complete" in again.stdout


def test_checkpoint_layout_and_pointers(prepared, tmp_path):
    c = copy_run(prepared, tmp_path / "c")
    run_script("04_train.py", c)
    d = Stage(c, 4).dir
    steps = sorted(p.name for p in d.glob("step-*"))
    best, latest = read_pointer(d, "best"), read_pointer(d, "latest")
    assert latest is not None and best is not None and best.name in steps
    assert len(steps) <= 3  # keep 2, plus best when it is older
    w = load_file(latest / "model.safetensors")
    assert "embed_tokens.weight" not in w
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert any(k.startswith("layers.0.") for k in w)
    spec = json.loads((latest / "config.json").read_text())
    assert spec["norm_before_residual"] is False
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    rec = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == list(range(1, len(rec) + 1))
    assert {"loss", "acc", "full_acc", "est_accept_len"} <= rec[-1].keys()
    assert "val" in rec[-1]
    assert (d / "metrics.png").is_file()


def test_incompatible_draft_shape_on_resume_fails(prepared, tmp_path):
    c = copy_run(prepared, tmp_path / "d")
    import yaml
    raw = yaml.safe_load(Path(c.source).read_text())
    raw["train"]["max_steps"] = 2
    Path(c.source).write_text(yaml.safe_dump(raw))
    run_script("04_train.py", c)
    # A finished stage with another draft shape asks for --restart.
    out = run_script("04_train.py", c, "draft.num_layers=2", check=False)
    assert out.returncode == 2 and "--restart" in out.stderr


def torchrun(cfg, *args, port, popen=False, log=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), "04_train.py", cfg.source, *args]
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=log, start_new_session=True)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def metrics(cfg):
    return [json.loads(x) for x in (Stage(cfg, 4).dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(prepared, tmp_path_factory):
    """Six steps on one process, two micro-batches per step."""
    one = copy_run(prepared, tmp_path_factory.mktemp("one"))
    run_script("04_train.py", one, "train.grad_accum=2", "train.max_steps=6")
    return one


@pytest.mark.parametrize("parallel,port", [("ddp", 29517), ("fsdp", 29527)])
def test_two_processes_match_one_process_with_the_same_global_batch(
        prepared, one_process, tmp_path, parallel, port):
    two = copy_run(prepared, tmp_path / "two")
    out = torchrun(two, "train.grad_accum=1", "train.max_steps=6", f"train.parallel={parallel}",
                   port=port)
    rec1, rec2 = metrics(one_process), metrics(two)
    assert len(rec1) == len(rec2) == 6
    for a, b in zip(rec1, rec2):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["acc"] == b["acc"]
        assert a.get("val") == b.get("val")
    counts = Stage(two, 4).manifest()["counts"]
    assert counts["world_size"] == 2 and counts["parallel"] == parallel
    # At the first epoch's end each rank holds the teacher statistics of every training sample,
    # those the other rank computed included (each computed about half).
    log = out.stdout + out.stderr
    cached = re.search(r"teacher cache: (\d+) samples", log)
    assert cached and int(cached.group(1)) >= counts["train_samples"], log[-3000:]
    # Checkpoints hold full tensors whatever the parallelism: the one-process layout, close
    # values, plain (unsharded) optimizer moments.
    w1 = load_file(find_latest(Stage(one_process, 4).dir) / "model.safetensors")
    w2 = load_file(find_latest(Stage(two, 4).dir) / "model.safetensors")
    assert {k: v.shape for k, v in w1.items()} == {k: v.shape for k, v in w2.items()}
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5, msg=k)
    opt = torch.load(find_latest(Stage(two, 4).dir) / "trainer_state.pt",
                     weights_only=False)["optimizer"]["state"]
    assert opt and all(type(v["exp_avg"]) is torch.Tensor for v in opt.values())


def test_fsdp_kill9_then_resume_equals_uninterrupted_and_resumes_under_ddp(prepared, tmp_path):
    a = copy_run(prepared, tmp_path / "a")
    b = copy_run(prepared, tmp_path / "b")
    args = ("train.max_steps=6", "train.parallel=fsdp")
    torchrun(a, *args, port=29537)
    proc = torchrun(b, *args, port=29547, popen=True, log=open(tmp_path / "b.log", "w"))
    train_dir = Stage(b, 4).dir
    wait_for(train_dir / "step-2", proc, tmp_path / "b.log")
    # torchrun starts its workers in their own sessions: kill every process of this run.
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", b.source])
    proc.wait()
    time.sleep(0.5)
    assert not Stage(b, 4).is_done()
    # The same crashed run resumed under DDP: checkpoints do not depend on the parallelism.
    c = copy_run(prepared, tmp_path / "c")
    shutil.copytree(train_dir, Stage(c, 4).dir)
    out = torchrun(b, *args, port=29557)
    assert "resumed from step-" in out.stdout + out.stderr
    la, lb = find_latest(Stage(a, 4).dir), find_latest(train_dir)
    assert la.name == lb.name == "step-6"
    wa, wb = load_file(la / "model.safetensors"), load_file(lb / "model.safetensors")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert metrics(a) == metrics(b)

    out = torchrun(c, "train.max_steps=6", "train.parallel=ddp", port=29567)
    assert "resumed from step-" in out.stdout + out.stderr
    wc = load_file(find_latest(Stage(c, 4).dir) / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wc[k], rtol=1e-4, atol=1e-5, msg=k)
    assert Stage(c, 4).manifest()["counts"]["parallel"] == "ddp"


def test_tensorboard_scalars_follow_metrics(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    c = copy_run(prepared, tmp_path / "tb")
    run_script("04_train.py", c, "train.max_steps=4", "train.tensorboard=true")
    acc = EventAccumulator(str(Stage(c, 4).dir / "tensorboard"))
    acc.Reload()
    rec = metrics(c)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rec]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rec], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/acc_2")] == pytest.approx(
        [r["acc"][2] for r in rec], rel=1e-6)
    val = acc.Scalars("val/est_accept_len")
    assert [e.step for e in val] == [r["step"] for r in rec if "val" in r]


def test_finetune_from_a_trained_checkpoint(prepared, tmp_path):
    base_run = copy_run(prepared, tmp_path / "base")
    run_script("04_train.py", base_run, "train.max_steps=2")
    base = find_latest(Stage(base_run, 4).dir)
    ft = copy_run(prepared, tmp_path / "ft")
    # Stage 03 now copies the base's vocabulary map (fine-tuning must not re-derive it).
    run_script("03_build_vocab_map.py", ft, f"train.finetune_from={base}", "--restart")
    out = run_script("04_train.py", ft, "--finetune-from", str(base), "train.max_steps=2")
    assert "fine-tuning from" in out.stdout + out.stderr
    manifest = Stage(ft, 4).manifest()
    assert manifest["finetune_from"]["path"] == str(base)
    vocab = Stage(ft, 3).manifest()
    assert "from_checkpoint" in json.dumps(vocab)
    # A base whose vocabulary map differs from 03_vocab is refused with its own message.
    bad = copy_run(prepared, tmp_path / "bad")
    out = run_script("04_train.py", bad, "--finetune-from", str(base), check=False)
    assert out.returncode == 2


def test_full_vocabulary_trains_exports_and_finetunes_without_a_map(prepared, tmp_path):
    """`vocab.draft_vocab_size=full`: stage 03 writes the identity, stage 04 trains the whole
    head (its checkpoints carry no d2t/t2d), stage 05 exports every format without them, and a
    fine-tune from that checkpoint reads its map as the identity."""
    full = copy_run(prepared, tmp_path / "full")
    over = ["vocab.draft_vocab_size=full", "train.max_steps=2",
            "export.formats=[vllm,sglang,speculators]"]
    run_script("03_build_vocab_map.py", full, *over, "--restart")
    vocab = Stage(full, 3).manifest()["counts"]
    assert vocab["draft_vocab_size"] == vocab["vocab_size"] and vocab["coverage"] == 1.0
    run_script("04_train.py", full, *over)
    step = find_latest(Stage(full, 4).dir)
    weights = load_file(step / "model.safetensors")
    assert not {"d2t", "t2d"} & set(weights)
    assert weights["lm_head.weight"].shape[0] == vocab["vocab_size"]
    run_script("05_fix_keys.py", full, *over)
    for fmt in ("vllm", "sglang", "speculators"):
        export = Stage(full, 5).dir / fmt
        assert not {"d2t", "t2d"} & set(load_file(export / "model.safetensors"))
        assert json.loads((export / "eagle3_export.json").read_text())["full_vocab"] is True
    ft = copy_run(prepared, tmp_path / "ft-full")
    run_script("03_build_vocab_map.py", ft, f"train.finetune_from={step}", "--restart")
    assert Stage(ft, 3).manifest()["counts"]["coverage"] == 1.0
    run_script("04_train.py", ft, "--finetune-from", str(step), "train.max_steps=1")


MLA = ["draft.attention=mla", "draft.q_lora_rank=16", "draft.kv_lora_rank=32",
       "draft.qk_nope_head_dim=16", "draft.qk_rope_head_dim=8", "draft.v_head_dim=16"]


def test_mla_draft_layer_trains_exports_and_finetunes(prepared, tmp_path):
    """`draft.attention=mla` (dimensions given: the tiny verifier is Llama): stage 04 trains an
    MLA layer and checkpoints it under vLLM's Eagle3DeepseekV2ForCausalLM config (speculators
    has no MLA class), stage 05 exports vLLM's and SGLang's layouts and refuses speculators in
    one line, and a fine-tune from the checkpoint reads it back as an MLA base."""
    mla = copy_run(prepared, tmp_path / "mla")
    over = [*MLA, "train.max_steps=2", "export.formats=[vllm,sglang]"]
    run_script("04_train.py", mla, *over)
    step = find_latest(Stage(mla, 4).dir)
    config = json.loads((step / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["kv_lora_rank"] == 32 and config["num_key_value_heads"] == config[
        "num_attention_heads"]
    weights = load_file(step / "model.safetensors")
    assert "layers.0.self_attn.kv_b_proj.weight" in weights
    assert not any(".q_proj." in k or ".k_proj." in k for k in weights)
    assert all(r["loss"] == r["loss"] for r in metrics(mla))  # finite, logged
    run_script("05_fix_keys.py", mla, *over)
    for fmt in ("vllm", "sglang"):
        record = json.loads((Stage(mla, 5).dir / fmt / "eagle3_export.json").read_text())
        assert record["attention"] == "mla", record
    out = run_script("05_fix_keys.py", mla, *over, "export.formats=[vllm,speculators]",
                     check=False)
    assert out.returncode == 2 and "speculators 0.9 has no MLA draft layer" in out.stderr
    ft = copy_run(prepared, tmp_path / "ft-mla")
    keep = [*MLA, "export.formats=[vllm,sglang]"]
    run_script("03_build_vocab_map.py", ft, *keep, f"train.finetune_from={step}", "--restart")
    out = run_script("04_train.py", ft, *MLA, "export.formats=[vllm,sglang]", "--finetune-from",
                     str(step), "train.max_steps=1", check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    wrong = copy_run(prepared, tmp_path / "ft-mha")
    run_script("03_build_vocab_map.py", wrong, f"train.finetune_from={step}", "--restart")
    out = run_script("04_train.py", wrong, "--finetune-from", str(step), "train.max_steps=1",
                     check=False)
    assert out.returncode == 2 and "set draft.attention=mla" in out.stderr


def test_tensorboard_missing_fails_before_training(prepared, tmp_path):
    c = copy_run(prepared, tmp_path / "notb")
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('tensorboard is not installed')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(shadow.parent)}
    out = subprocess.run([sys.executable, "04_train.py", c.source, "train.tensorboard=true"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pip install tensorboard" in out.stderr
    assert not list(Stage(c, 4).dir.glob("step-*"))


def test_bf16_autocast_on_cpu(prepared, tmp_path):
    """train.autocast=bf16 really computes in bf16 (the loss moves off the fp32 one, slightly)
    and leaves weights and checkpoints in fp32."""
    fp32, bf16 = copy_run(prepared, tmp_path / "fp32"), copy_run(prepared, tmp_path / "bf16")
    run_script("04_train.py", fp32, "train.max_steps=6")
    run_script("04_train.py", bf16, "train.max_steps=6", "train.autocast=bf16")
    # The random drafter's logits are near 0, so the loss hardly sees bf16 rounding at first;
    # the gradient norms do.
    ga, gb = [r["grad_norm"] for r in metrics(fp32)], [r["grad_norm"] for r in metrics(bf16)]
    assert ga != gb
    assert gb == pytest.approx(ga, rel=0.05, abs=1e-3)
    assert [r["loss"] for r in metrics(bf16)] == pytest.approx(
        [r["loss"] for r in metrics(fp32)], rel=0.01)
    w = load_file(find_latest(Stage(bf16, 4).dir) / "model.safetensors")
    assert w["fc.weight"].dtype == torch.float32


def test_smoke_runs_two_steps_on_the_longest_samples_and_writes_nothing(prepared, tmp_path):
    """`04_train.py --smoke`: peak memory and speed of the heaviest micro-batch, no checkpoint,
    metric or manifest; the real run afterwards starts from step 0."""
    c = copy_run(prepared, tmp_path / "smoke")
    out = run_script("04_train.py", c, "--smoke")
    text = out.stdout + out.stderr
    line = next(x for x in text.splitlines() if "smoke:" in x)
    from eagle3.shards import HiddenStates
    from eagle3.train import split_indices
    data = HiddenStates(Stage(c, 2).dir)
    train_idx, _ = split_indices(data.ids, c.train.val_fraction, c.train.seed)
    longest = min(max(data.num_tokens(i) for i in train_idx), c.train.batch_tokens)
    assert f"(longest {longest})" in line, line
    assert "peak resident size" in line and "tokens/s" in line
    assert "nothing written" in line
    train_dir = Stage(c, 4).dir
    assert not step_dirs(train_dir) and not (train_dir / "manifest.json").exists()
    assert not (train_dir / "metrics.jsonl").exists()
    assert Stage(c, 4).check_done() is False
