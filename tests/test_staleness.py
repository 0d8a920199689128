"""Never a stale or mixed drafter: a redone upstream stage makes every reader out of date, a
resumed run refuses a changed recipe, and `04 --repair` repairs or refuses (docs/errors.md).

    .venv/bin/pytest tests/test_staleness.py -q
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_config
from test_bad_inputs import UPSTREAM, one_line_error, run_stage
from eagle3.runs import Stage

PROMPTS = ["Explain why the sky looks blue during the day in two sentences.",
           "Write a short poem about a lighthouse keeper and the sea at night.",
           "List three good habits for writing clear and readable Python code.",
           "What is the difference between a list and a tuple in Python exactly?",
           "Describe how a bicycle gear system helps a rider climb steep hills.",
           "Give me a simple recipe for pancakes that uses only five ingredients.",
           "Summarise the plot of a detective story in which the butler is innocent.",
           "Why do cats purr, and what does it tell us about how they are feeling?",
           "Suggest a name for a small bakery that sells bread and cinnamon rolls.",
           "How do I explain recursion to a ten year old child using an example?"]


def run(script, cfg, *extra):
    """A stage run from the config's folder: the prompts file is `prompts.jsonl` there, so a
    copied run reads its own copy under the same configured name."""
    return run_stage(script, cfg, *extra, cwd=Path(cfg.source).parent)


def write_prompts(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                            for p in prompts))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_verifier):
    """Stages 01-05 on the tiny verifier, prompts from a local file."""
    tmp = tmp_path_factory.mktemp("stale")
    data = tmp / "prompts.jsonl"
    write_prompts(data, PROMPTS)
    cfg = make_config(tmp, tiny_verifier,
                      data={"sources": [data.name], "num_samples": 10, "max_seq_len": 96},
                      train={"epochs": 2, "batch_tokens": 96, "checkpoint_every": 2,
                             "ttt_steps": 2, "keep": 5},
                      export={"formats": ["vllm"]})
    for script in [*UPSTREAM, "04_train.py", "05_fix_keys.py"]:
        out = run(script, cfg)
        assert out.returncode == 0, script + out.stderr[-3000:]
    return cfg, data


def copy_all(cfg, data: Path, dest: Path):
    """The finished run, its prompts file and its config, copied under `dest`."""
    import yaml
    from eagle3.config import load_config
    shutil.copytree(cfg.run_dir, dest / "runs" / cfg.run.name,
                    ignore=shutil.ignore_patterns(".locks"))
    shutil.copy(data, dest / data.name)
    raw = yaml.safe_load(Path(cfg.source).read_text())
    raw["run"]["dir"] = str(dest / "runs")
    (dest / "config.yaml").write_text(yaml.safe_dump(raw))
    return load_config(dest / "config.yaml"), dest / data.name


def test_an_edited_data_file_makes_every_later_stage_out_of_date(trained, tmp_path):
    cfg, data = copy_all(*trained, tmp_path)
    write_prompts(data, PROMPTS[::-1][:9] + ["A new prompt that was not there before, about owls."])

    msg = one_line_error(run("01_generate_data.py", cfg))
    assert "01_data already exists with another config (data files (content)" in msg
    assert run("01_generate_data.py", cfg, "--restart").returncode == 0

    for script, name in [("02_extract_hidden_states.py", "02_hidden_states"),
                         ("03_build_vocab_map.py", "03_vocab")]:
        msg = one_line_error(run(script, cfg))
        assert f"{name} already exists with another config (data files (content)" in msg
        assert "--restart" in msg
    # A later stage names the first stage of the chain to redo, with the command's overrides.
    msg = one_line_error(run("05_fix_keys.py", cfg, "train.log_every=3"))
    assert "02_hidden_states was made with another config (data files (content)" in msg
    assert f"python 02_extract_hidden_states.py {cfg.source} train.log_every=3 --restart" in msg


def _rewrite_checkpoint(step_dir: Path, change) -> None:
    """Change a checkpoint's weights as a retrain on other hardware would (GPU kernels are not
    bitwise deterministic), keeping its own record consistent."""
    from safetensors.torch import save_file
    from eagle3.runs import file_record
    weights = load_file(step_dir / "model.safetensors")
    change(weights)
    save_file(weights, str(step_dir / "model.safetensors"), metadata={"format": "pt"})
    record = json.loads((step_dir / "checkpoint.json").read_text())
    record["files"]["model.safetensors"] = file_record(step_dir / "model.safetensors")
    (step_dir / "checkpoint.json").write_text(json.dumps(record))


def _rerecord(stage: Stage) -> None:
    """Stage's manifest re-made over its current files (as its own finish would write it)."""
    from eagle3.runs import atomic_write_json, file_records
    manifest = stage.manifest()
    manifest["files"] = file_records(stage.dir, [stage.dir / n for n in manifest["files"]])
    atomic_write_json(stage.manifest_path, manifest)


def test_a_retrained_drafter_is_exported_again(trained, tmp_path):
    cfg, _ = copy_all(*trained, tmp_path)
    assert run("04_train.py", cfg, "--restart").returncode == 0
    train = Stage(cfg, 4)
    best = train.dir / (train.dir / "best").read_text().strip()
    _rewrite_checkpoint(best, lambda w: w.__setitem__("fc.weight", -w["fc.weight"]))
    _rerecord(train)

    out = run("05_fix_keys.py", cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "04_train was redone after it was made" in out.stdout
    exported = load_file(Stage(cfg, 5).dir / "vllm" / "model.safetensors")["fc.weight"]
    assert torch.equal(exported, load_file(best / "model.safetensors")["fc.weight"].to(
        exported.dtype))


def test_a_resume_refuses_a_changed_recipe(trained, tmp_path):
    cfg, _ = copy_all(*trained, tmp_path)
    (Stage(cfg, 4).manifest_path).unlink()  # killed after its last checkpoint
    msg = one_line_error(run("04_train.py", cfg, "train.lr=0.01"))
    assert "was trained with other settings (train.lr: 0.001 there, 0.01 now)" in msg
    assert f"python 04_train.py {cfg.source} train.lr=0.01 --restart" in msg
    out = run("04_train.py", cfg)  # the same recipe resumes
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("damage", ["bit flip", "dangling"])
def test_repair_moves_best_off_a_damaged_checkpoint(trained, tmp_path, damage):
    cfg, _ = copy_all(*trained, tmp_path)
    train = Stage(cfg, 4)
    steps = sorted(p.name for p in train.dir.glob("step-*"))
    named = (train.dir / "best").read_text().strip()
    if damage == "bit flip":
        weights = train.dir / named / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x10
        weights.write_bytes(bytes(data))
    else:
        shutil.rmtree(train.dir / named)
    msg = one_line_error(run("05_fix_keys.py", cfg))
    assert "04_train is damaged" in msg and "--repair" in msg

    out = run("04_train.py", cfg, "--repair")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"`best` named {named}, which is damaged or missing" in out.stdout
    # best is an intact checkpoint again (the same step when it was also the newest: redone
    # from the one before, deterministically), and the manifest vouches only for intact files
    assert (train.dir / "best").read_text().strip() in steps
    assert not train.damage(train.manifest())
    assert run("05_fix_keys.py", cfg).returncode == 0
    assert run("04_train.py", cfg).returncode == 0  # complete, and intact


def test_a_no_op_repair_leaves_later_stages_up_to_date(trained, tmp_path):
    cfg, _ = copy_all(*trained, tmp_path)
    assert run("03_build_vocab_map.py", cfg, "--repair").returncode == 0
    out = run("04_train.py", cfg)
    assert out.returncode == 0 and "already complete" in out.stdout, out.stderr[-2000:]

    # 03 redone to another result under the same config (e.g. other data of stage 01 read by a
    # newer tokenizer): everything after it is out of date.
    from safetensors.torch import save_file
    vocab = Stage(cfg, 3)
    maps = load_file(vocab.dir / "vocab.safetensors")
    maps["d2t"] = maps["d2t"].roll(1)
    save_file(maps, str(vocab.dir / "vocab.safetensors"))
    _rerecord(vocab)
    msg = one_line_error(run("04_train.py", cfg))
    assert "04_train is out of date: 03_vocab was redone after it was made; add --restart" in msg
    msg = one_line_error(run("05_fix_keys.py", cfg))
    assert "04_train is out of date: 03_vocab was redone after it was made; rerun `python " \
           "04_train.py" in msg


def test_a_trainer_state_that_is_not_plain_data_is_refused(trained, tmp_path):
    from eagle3 import checkpoint
    from eagle3.runs import StageError

    class Payload:
        def __reduce__(self):
            return (print, ("this ran from a crafted trainer_state.pt",))

    cfg, _ = copy_all(*trained, tmp_path)
    step = sorted(Stage(cfg, 4).dir.glob("step-*"))[-1]
    torch.save({"world_size": 1, "x": Payload()}, step / "trainer_state.pt")
    with pytest.raises(StageError, match="holds more than tensors and plain data"):
        checkpoint.load(step, with_trainer_state=True)

