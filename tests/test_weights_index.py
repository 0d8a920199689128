"""Reading a directory of weights: every tensor from the file the index names, refusals in one
line naming the file and the key; one width check for stage 04 and `05_fix_keys.py --from`;
non-finite weights refused at load; `model.`-prefixed drafters read as the drafters they are.

    .venv/bin/pytest tests/test_weights_index.py -q
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3 import convert, weights_io
from eagle3.base_drafter import (BaseDrafterError, check_base, finetune_draft_config,
                                 verifier_fit_problems)
from eagle3.base_drafter import load as load_base_drafter
from eagle3.runs import StageError
from eagle3.verifier import check_weights, read_tensor
from test_convert import convert_dir
from test_finetune import _H, _V, DRAFT, edit, finetuned, logits_of, random_model, write_base

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def shard(directory: Path, index: bool = True) -> dict[str, torch.Tensor]:
    """Split `directory`'s model.safetensors into two shards (keys alternating) with an index
    (or none); returns the tensors."""
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for name, part in zip(SHARDS, (keys[::2], keys[1::2])):
        save_file({k: tensors[k] for k in part}, str(directory / name))
        weight_map.update({k: name for k in part})
    if index:
        (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def shard_of(directory: Path, key: str) -> str:
    return json.loads((directory / INDEX).read_text())["weight_map"][key]


def add_to(file: Path, **tensors: torch.Tensor) -> None:
    """Rewrite one shard with more tensors in it."""
    save_file({**load_file(str(file)), **tensors}, str(file))


def edit_index(directory: Path, change) -> None:
    index = json.loads((directory / INDEX).read_text())
    change(index["weight_map"])
    (directory / INDEX).write_text(json.dumps(index))


def verifier_config(tmp_path: Path, hidden: int = _H, vocab: int = _V) -> Path:
    """A verifier as `05_fix_keys.py --from` reads it for a drafter that ships no embedding:
    its config.json alone."""
    out = tmp_path / "verifier"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": 8, "vocab_size": vocab, "num_attention_heads": 4,
        "intermediate_size": 64}))
    return out


def refusal(directory: Path) -> str:
    """The one line `--finetune-from` refuses `directory` with."""
    with pytest.raises(BaseDrafterError) as e:
        load_base_drafter(directory)
    assert "\n" not in str(e.value)
    return str(e.value)


def convert_error(src: Path, out: Path, capsys, *extra: str) -> str:
    """`05_fix_keys.py --from src`: exit code 2 and one `error:` line."""
    code = convert.convert_main(["--from", str(src), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not any(out.glob("*/model.safetensors"))
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Sharded weights are read by their index


def test_a_stale_copy_in_another_shard_is_refused_not_exported(tmp_path, capsys):
    """The index maps fc.weight to one shard, another also holds a zeros fc.weight: the
    engines would load whichever they read last, so neither stage picks one silently."""
    base = write_base(tmp_path, "vllm", random_model())
    tensors = shard(base)
    mapped = shard_of(base, "fc.weight")
    stale = next(name for name in SHARDS if name != mapped)
    add_to(base / stale, **{"fc.weight": torch.zeros_like(tensors["fc.weight"])})
    for line in (refusal(base),
                 convert_error(base, tmp_path / "out", capsys, "--verifier",
                               str(verifier_config(tmp_path)))):
        assert "`fc.weight` is in two files" in line
        assert SHARDS[0] in line and SHARDS[1] in line and f"index maps it to {mapped}" in line


def test_a_key_the_index_does_not_map_is_refused(tmp_path):
    base = write_base(tmp_path, "vllm", random_model())
    shard(base)
    held = shard_of(base, "norm.weight")
    edit_index(base, lambda m: m.pop("norm.weight"))
    assert f"{held} holds `norm.weight`, which {INDEX} does not map" in refusal(base)


def test_a_key_mapped_to_a_shard_without_it_is_refused(tmp_path):
    base = write_base(tmp_path, "vllm", random_model())
    shard(base)
    name = shard_of(base, "lm_head.weight")
    kept = {k: v for k, v in load_file(str(base / name)).items() if k != "lm_head.weight"}
    save_file(kept, str(base / name))
    assert f"{INDEX} maps `lm_head.weight` to {name}, which does not hold it" in refusal(base)


def test_an_index_naming_a_missing_shard_names_it_and_a_key(tmp_path):
    base = write_base(tmp_path, "vllm", random_model())
    shard(base)
    (base / SHARDS[1]).unlink()
    line = refusal(base)
    assert f"{INDEX} maps `" in line and f"to {SHARDS[1]}, which is missing" in line


def test_without_an_index_every_shard_is_read_and_a_key_in_two_is_refused(tmp_path, capsys):
    ref = random_model()
    base = write_base(tmp_path, "vllm", ref)
    tensors = shard(base, index=False)
    model = finetuned(base, DRAFT, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    add_to(base / SHARDS[1], **{"d2t": torch.zeros_like(tensors["d2t"])})
    line = refusal(base)
    assert f"`d2t` is in two files, {SHARDS[0]} and {SHARDS[1]}" in line
    assert "index maps" not in line


def test_the_verifier_is_read_by_its_index_and_checked_against_it(tmp_path):
    """Stage checks (`check_weights`) and single-tensor reads use the same checked map; a
    shard rewritten after a first read is seen (the map is cached per directory state)."""
    verifier = tmp_path / "v"
    verifier.mkdir()
    embed = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)},
              str(verifier / SHARDS[0]))
    save_file({"lm_head.weight": torch.randn(10, 4)}, str(verifier / SHARDS[1]))
    (verifier / INDEX).write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": SHARDS[0], "model.norm.weight": SHARDS[0],
        "lm_head.weight": SHARDS[1]}}))
    check_weights(verifier)
    assert torch.equal(read_tensor(verifier, "embed"), embed)
    add_to(verifier / SHARDS[1], **{"model.embed_tokens.weight": torch.zeros(10, 4)})
    for read in (check_weights, lambda v: read_tensor(v, "embed")):
        with pytest.raises(StageError) as e:
            read(verifier)
        assert "\n" not in str(e.value)
        assert (f"`model.embed_tokens.weight` is in two files, {SHARDS[0]} and {SHARDS[1]}"
                in str(e.value))


def test_a_truncated_verifier_shard_is_still_named_as_truncated(tmp_path):
    verifier = tmp_path / "v"
    verifier.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(10, 4)}, str(verifier / SHARDS[0]))
    save_file({"lm_head.weight": torch.randn(10, 4)}, str(verifier / SHARDS[1]))
    (verifier / INDEX).write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": SHARDS[0], "lm_head.weight": SHARDS[1]}}))
    data = (verifier / SHARDS[1]).read_bytes()
    (verifier / SHARDS[1]).write_bytes(data[:-8])
    with pytest.raises(StageError, match=f"verifier weights .*{SHARDS[1]} are truncated"):
        check_weights(verifier)


# ---------------------------------------------------------------------------------------------
# One width check for stage 04 and 05 --from


def narrow_drafter(tmp_path: Path, hidden: int, verifier_hidden: int) -> Path:
    """A drafter `hidden` wide reading `verifier_hidden`-wide aux states: every tensor
    consistent with its own config, so only the verifier's width tells it apart."""
    cfg = dataclasses.replace(DRAFT, hidden_size=hidden, target_hidden_size=verifier_hidden,
                              head_dim=hidden // DRAFT.num_attention_heads)
    base = write_base(tmp_path, "vllm", random_model(cfg), name=f"narrow-{hidden}")
    edit(base, config=lambda c: c.update(target_hidden_size=verifier_hidden))
    return base


def test_a_drafter_narrower_than_the_verifier_is_refused_by_both_stages(tmp_path, capsys):
    wide = 4 * _H
    base = narrow_drafter(tmp_path, _H, wide)
    shared = f"the drafter is {_H} wide (hidden_size), the verifier {wide}"
    line = convert_error(base, tmp_path / "out", capsys, "--verifier",
                         str(verifier_config(tmp_path, hidden=wide)))
    assert shared in line
    # stage 04: our drafter takes its widths from the verifier (train.draft_model_config)
    ours = dataclasses.replace(DRAFT, hidden_size=wide, target_hidden_size=wide,
                               head_dim=wide // DRAFT.num_attention_heads)
    loaded = load_base_drafter(base)
    with pytest.raises(BaseDrafterError) as e:
        check_base(loaded, finetune_draft_config(ours, loaded), torch.zeros(_V, wide))
    assert any(p.startswith(shared) for p in e.value.problems)
    assert verifier_fit_problems(loaded.shape, wide, _V)[0] in line


def test_without_the_verifier_a_drafter_narrower_than_its_aux_states_is_refused(tmp_path,
                                                                                capsys):
    base = narrow_drafter(tmp_path, _H, 2 * _H)
    line = convert_error(base, tmp_path / "out", capsys, "--formats", "vllm")
    assert f"the drafter is {_H} wide (hidden_size) but reads {2 * _H}-wide" in line


# ---------------------------------------------------------------------------------------------
# Non-finite weights are refused at load


def test_nan_weights_are_refused_at_load_naming_tensor_and_file(tmp_path, capsys):
    base = write_base(tmp_path, "sglang", random_model())

    def poison(t):
        t["midlayer.mlp.up_proj.weight"][5, 3] = float("nan")
        t["norm.weight"][0] = float("inf")

    edit(base, tensors=poison)
    line = refusal(base)
    assert ("`midlayer.mlp.up_proj.weight` in model.safetensors has NaN or infinite values "
            "(and 1 more tensors)") in line
    line = convert_error(base, tmp_path / "out", capsys, "--verifier",
                         str(verifier_config(tmp_path)))
    assert "`midlayer.mlp.up_proj.weight` in model.safetensors has NaN" in line


def test_non_finite_weights_in_a_shard_name_the_shard(tmp_path):
    base = write_base(tmp_path, "vllm", random_model())
    shard(base)
    name = shard_of(base, "fc.weight")
    tensors = load_file(str(base / name))
    tensors["fc.weight"][-1, -1] = float("-inf")
    save_file(tensors, str(base / name))
    assert f"`fc.weight` in {name} has NaN or infinite values" in refusal(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finiteness_is_read_a_block_of_rows_at_a_time(tmp_path, dtype):
    t = torch.randn(40, 6).to(dtype)
    save_file({"w": t, "s": torch.tensor(1.5, dtype=dtype), "i": torch.arange(3)},
              str(tmp_path / "w.safetensors"))
    lazy = weights_io.open_file(tmp_path / "w.safetensors")
    assert all(weights_io.all_finite(v, block_bytes=16) for v in lazy.values())
    t[39, 5] = float("nan")
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    assert not weights_io.all_finite(weights_io.open_file(tmp_path / "w.safetensors")["w"],
                                     block_bytes=16)


# ---------------------------------------------------------------------------------------------
# A wrapper's `model.` prefix


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_model_prefixed_body_with_top_level_head_and_maps(tmp_path, fmt):
    """As an HF `...ForCausalLM` saves a drafter: `model.fc.weight`, `model.layers.0.*` (or
    `model.midlayer.*`), with `lm_head.weight`, `d2t` and `t2d` at top level."""
    ref = random_model()
    base = write_base(tmp_path, fmt, ref)
    edit(base, tensors=lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)
                                           if k not in ("lm_head.weight", "d2t", "t2d")}))
    assert "model.fc.weight" in load_file(str(base / "model.safetensors"))
    model = finetuned(base, DRAFT, ref.embed_tokens.weight)
    for a, b in zip(logits_of(ref), logits_of(model)):
        assert torch.equal(a, b)
    report = convert_dir(base, tmp_path / "out", "--verifier", str(verifier_config(tmp_path)),
                         "--formats", "vllm")
    assert report["formats"]["vllm"]["num_keys"] == len(ref.trainable_state_dict())


def test_both_spellings_of_one_tensor_are_refused(tmp_path):
    base = write_base(tmp_path, "vllm", random_model())
    edit(base, tensors=lambda t: t.update({"model.fc.weight": torch.zeros_like(t["fc.weight"])}))
    line = refusal(base)
    assert "`fc.weight` and `model.fc.weight` are the same tensor `fc.weight`" in line
