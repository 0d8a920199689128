"""Stage 02 on the tiny random verifier: exact capture, resume, disk check, reader.

    .venv/bin/pytest tests/test_hidden_states.py -q
"""

import collections
import dataclasses
import json
import time

import pytest
import torch

from conftest import make_config
from eagle3 import hidden_states as hs_mod
from eagle3.hidden_states import HiddenStates, run_extract
from eagle3.runs import Stage, StageError

AUX_IDS = [1, 2, 3]
LENGTHS = [5, 17, 9, 30, 2, 12, 25]


def _stage01(cfg):
    """Write a small stage-01 dataset and manifest directly (generation is tested elsewhere)."""
    from datasets import Dataset, Features, Sequence, Value

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[int(i >= n // 2) for i in range(n)] for n in LENGTHS]
    features = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                         "loss_mask": Sequence(Value("int8"))})
    stage = Stage(cfg, 1)
    Dataset.from_dict({"id": [f"s{i}" for i in range(len(LENGTHS))], "input_ids": ids,
                       "loss_mask": masks}, features=features).save_to_disk(
        str(stage.dir / "dataset"))
    stage.write_manifest(inputs={}, outputs={"dataset": "dataset"}, counts={},
                         started=time.time())
    return ids, masks


@pytest.fixture
def hs_config(tmp_path, tiny_verifier):
    # The 4-layer default (2, 2, 1) is not a valid selection; pick three distinct layers.
    # (make_config's own `verifier` argument is the path, so the section is replaced here.)
    cfg = make_config(tmp_path, tiny_verifier,
                      hidden_states={"shard_samples": 3, "dtype": "float32",
                                     "batch_tokens": 40})
    return dataclasses.replace(cfg, verifier=dataclasses.replace(cfg.verifier,
                                                                 aux_layer_ids=AUX_IDS))


def test_capture_matches_hf_and_reader(hs_config, tiny_verifier):
    from transformers import AutoModelForCausalLM

    ids, masks = _stage01(hs_config)
    stage = Stage(hs_config, 2)
    run_extract(stage)
    assert stage.is_done()
    index = json.loads((stage.dir / "index.json").read_text())
    assert index["aux_layer_ids"] == AUX_IDS
    assert index["aux_layer_convention"] == "hf_output_hidden_states"
    assert index["final_state"] == "post_norm"
    assert [s["samples"] for s in index["shards"]] == [3, 3, 1]
    assert index["num_tokens"] == sum(LENGTHS)

    reader = HiddenStates(stage.dir)
    assert len(reader) == len(LENGTHS) and reader.ids == [f"s{i}" for i in range(7)]
    assert reader.aux_layer_ids == AUX_IDS and reader.final_is_post_norm
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    h = model.config.hidden_size
    for i in range(len(LENGTHS)):
        sample = reader[i]
        assert reader.num_tokens(i) == LENGTHS[i]
        assert sample["input_ids"].dtype == torch.long and sample["loss_mask"].dtype == torch.long
        assert sample["input_ids"].tolist() == ids[i]
        assert sample["loss_mask"].tolist() == masks[i]
        assert sample["aux"].shape == (LENGTHS[i], len(AUX_IDS) * h)
        assert sample["final"].shape == (LENGTHS[i], h)
        with torch.no_grad():
            out = model(torch.tensor([ids[i]]), output_hidden_states=True)
            for k, j in enumerate(AUX_IDS):
                torch.testing.assert_close(sample["aux"][:, k * h:(k + 1) * h],
                                           out.hidden_states[j][0], atol=1e-5, rtol=0)
            # Post-norm: the verifier's own head on the stored state gives its logits, with
            # no second norm.
            torch.testing.assert_close(model.lm_head(sample["final"]), out.logits[0],
                                       atol=1e-5, rtol=0)
    manifest = stage.manifest()
    assert manifest["counts"]["tokens"] == sum(LENGTHS)
    assert manifest["aux_layer_ids"] == AUX_IDS


def test_resume_redoes_damaged_shards_identically(hs_config):
    _stage01(hs_config)
    stage = Stage(hs_config, 2)
    run_extract(stage)
    names = [f"shard-{k:05d}.safetensors" for k in range(3)]
    reference = {n: (stage.dir / n).read_bytes() for n in names}
    kept = (stage.dir / names[0]).stat().st_mtime_ns

    # A crash: no manifest or index, shard 1 cut short, shard 2 never written.
    (stage.dir / "manifest.json").unlink()
    (stage.dir / "index.json").unlink()
    (stage.dir / names[1]).write_bytes(reference[names[1]][: len(reference[names[1]]) // 2])
    (stage.dir / names[2]).unlink()
    assert not stage.is_done()
    run_extract(stage)
    assert stage.is_done()
    assert {n: (stage.dir / n).read_bytes() for n in names} == reference
    assert (stage.dir / names[0]).stat().st_mtime_ns == kept  # complete shard not rewritten
    assert stage.manifest()["counts"]["bytes_written_this_run"] == \
        len(reference[names[1]]) + len(reference[names[2]])


def test_disk_check_refuses(hs_config, monkeypatch):
    _stage01(hs_config)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(hs_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    stage = Stage(hs_config, 2)
    needed = sum(LENGTHS) * (3 + 1) * 64 * 4 + sum(LENGTHS) * 9
    with pytest.raises(StageError, match=f"{needed} bytes"):
        run_extract(stage)
    assert not any(stage.dir.glob("shard-*"))


def test_non_finite_state_names_sample(hs_config, monkeypatch):
    _stage01(hs_config)
    real = hs_mod.capture_samples

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        aux, final = out[1]
        final = final.clone()
        final[0, 0] = float("nan")
        out[1] = (aux, final)
        return out

    monkeypatch.setattr(hs_mod, "capture_samples", poisoned)
    with pytest.raises(StageError, match="sample s1 "):
        run_extract(Stage(hs_config, 2))


def test_requires_stage01(hs_config):
    with pytest.raises(StageError, match="01_generate_data.py"):
        run_extract(Stage(hs_config, 2))
