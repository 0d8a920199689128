"""Stage 02: capture the verifier's aux and final hidden states; the shard writer and reader.

    python 02_extract_hidden_states.py configs/smollm2-135m-cpu.yaml [hidden_states.dtype=fp8_e4m3]
    torchrun --nproc-per-node 8 02_extract_hidden_states.py CONFIG      # hf backend, 8 ranks
    python 02_extract_hidden_states.py configs/kimi-k2.5.yaml           # vllm backend (Kimi)

    hs = HiddenStates("runs/smollm2-135m-cpu/02_hidden_states")
    sample = hs[0]   # {"input_ids", "loss_mask", "aux" [T, n_aux*Ht], "final" [T, Ht]}

One convention. Aux ids are HF `output_hidden_states` indices (0 = embeddings, j = output of
decoder layer j-1 = the residual stream entering layer j; vLLM and new SGLang use the same
numbers). The stored final state is **post final norm** (HF's `last_hidden_state`), so
`lm_head(final)` are the verifier's logits and the trainer never norms it again. An aux id equal
to the layer count is the last layer's raw, pre-norm output (as engines capture it); that is the
only index where the tensor differs from HF's post-norm `output_hidden_states[-1]`.

Backend `hf` (any verifier that fits in this process's devices): only the text decoder is
built (for a multimodal wrapper such as Kimi-K2.5, the model under `text_config`) and only its
weights are read, each once, straight onto the device that runs it: no lm_head, vision tower
or MTP layers.
Forward hooks keep just the aux layers' outputs. Samples of a shard are length-sorted and cut
into batches of at most `hidden_states.batch_tokens` padded tokens, right-padded, and each
sample is sliced back to its own length, so padding is never written. Under torchrun each
rank writes the shards `k` with `k % world_size == rank`; a shard's bytes do not depend on the
rank count. `hidden_states.device_map=auto` splits the decoder layers over this rank's share of
the visible GPUs, for a verifier larger than one device.

Backend `vllm` (the Kimi-K2.5 path: a 1T-parameter INT4 MoE that only an engine holds on an
8-GPU node): a vLLM server is started by `eagle3.engines.vllm_server` (or reached at
`hidden_states.vllm_url`) with
    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [A.., N]}}}'
    --kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}'
and every sample is one `/v1/completions` request (prompt = its token ids, max_tokens 1).
The reply's `kv_transfer_params.hidden_states_path` names a safetensors file with
`hidden_states` [T, len(ids), Ht] (ids ascending; N = layer count = the last layer's pre-norm
output) and `token_ids` [T]; the client waits on the file's `.lock` (flock), checks the tokens,
applies the verifier's final RMSNorm to slot N (so the final state is post-norm, exactly as in
the hf backend), deletes the file and writes the same shards as the hf backend. The client
must see the server's storage directory (same node). Set `hidden_states.vllm_args` to e.g.
[--tensor-parallel-size, "8", --trust-remote-code]. vLLM 0.32's CPU build cannot run this
(ENVIRONMENT.md); the client is tested against responses in vLLM's exact format. On a new
node or vLLM version, first run a handful of samples (data.num_samples=4): vLLM's hidden-state
cache is an MLA-typed KV spec and its grouping next to MLA verifiers has had bugs (vLLM
#53243 / PR #53074 for DeepSeek-V4); the connector stops with "MLA verifiers are unsupported"
when it cannot isolate the group.

Storage (`hidden_states.dtype`): `bfloat16` (default) or `float32` for every state, or
`fp8_e4m3`: aux as float8_e4m3fn with one float32 scale per (token, aux layer) row
(`aux_scale` [N, n_aux], amax / 448), final kept bfloat16. The reader returns dequantized
floating tensors. Bytes per token = n_aux*Ht*aux_bytes + Ht*final_bytes + 4*n_aux (fp8 only)
+ 8 (token id) + 1 (mask); the total is printed before starting and a disk without it plus
10% refuses to start.

Output under `02_hidden_states/`:
- `shard-NNNNN.safetensors`: `hidden_states.shard_samples` consecutive dataset samples,
  token-concatenated: `input_ids` [N] int64, `loss_mask` [N] uint8, `aux` [N, n_aux*Ht],
  `final` [N, Ht], (`aux_scale` [N, n_aux] float32 for fp8), `offsets` [samples+1] int64;
  metadata key `eagle3` = JSON {format, ids, aux_layer_ids, convention, final_state, dtype,
  hidden_size, verifier}.
- `shard-NNNNN.json`: its index entry {file, samples, tokens, bytes, sha256}, written after
  the shard. A shard counts as done only when both exist and size, sha256, sample ids and
  facts all agree; otherwise it is redone. Shards are written to a temporary name, fsynced and
  renamed, so a kill -9 never leaves one that looks complete, and a redone shard is byte-
  identical to an uninterrupted run's.
- `index.json` (all entries, totals, facts) and `manifest.json`, written last by rank 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from eagle3 import dist
from eagle3.runs import (Stage, StageError, atomic_path, atomic_write_json, clean_stale_tmp,
                         file_sha256)

log = logging.getLogger("eagle3")

FORMAT = "eagle3-hidden-states-v2"
READABLE_FORMATS = ("eagle3-hidden-states-v1", FORMAT)
INDEX = "index.json"
AUX_CONVENTION = "hf_output_hidden_states"
FINAL_STATE = "post_norm"
DISK_MARGIN = 0.10
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# storage dtype -> (aux tensor dtype, final tensor dtype)
STORAGE = {"float32": (torch.float32, torch.float32),
           "bfloat16": (torch.bfloat16, torch.bfloat16),
           "fp8_e4m3": (torch.float8_e4m3fn, torch.bfloat16)}
TENSORS = ("input_ids", "loss_mask", "aux", "final", "offsets")
VLLM_STORAGE = ".vllm_hidden_states"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def entry_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def bytes_per_token(n_aux: int, hidden: int, dtype: str) -> int:
    """Tensor bytes one token takes in a shard: states (+ fp8 scales), token id, mask."""
    aux_t, final_t = STORAGE[dtype]
    scales = 4 * n_aux if aux_t == torch.float8_e4m3fn else 0
    return n_aux * hidden * aux_t.itemsize + hidden * final_t.itemsize + scales + 8 + 1


# ---------------------------------------------------------------------------------------------
# Encoding


def quantize_fp8(aux: torch.Tensor, n_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 aux [T, n_aux*H] with one float32 scale per (token, aux layer) row."""
    x = aux.float().reshape(aux.shape[0], n_aux, -1)
    # An all-zero row keeps a tiny scale instead of 0 so that dequantization never divides.
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(aux.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n_aux = scale.shape[-1]
    x = q.float().reshape(q.shape[0], n_aux, -1) * scale[..., None]
    return x.reshape(q.shape)


def encode(aux: torch.Tensor, final: torch.Tensor, dtype: str,
           n_aux: int) -> dict[str, torch.Tensor]:
    """The stored tensors of one sample's states."""
    aux_t, final_t = STORAGE[dtype]
    if aux_t == torch.float8_e4m3fn:
        q, scale = quantize_fp8(aux, n_aux)
        return {"aux": q, "aux_scale": scale, "final": final.to(final_t)}
    return {"aux": aux.to(aux_t), "final": final.to(final_t)}


def check_finite(sample_id: str, shard: int, aux: torch.Tensor, final: torch.Tensor,
                 verifier_dtype: str) -> None:
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise StageError(f"non-finite hidden state for sample {sample_id} (shard {shard}): the "
                         f"verifier overflows in {verifier_dtype}; try verifier.dtype=float32 "
                         f"or drop the sample")


# ---------------------------------------------------------------------------------------------
# Shard files


def read_shard_header(path: Path) -> dict[str, Any] | None:
    """The safetensors header of `path`, or None when the file is truncated or not one.

    Checks that the tensor data ends exactly at the end of the file, so a cut-off shard is never
    taken as complete.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):  # ValueError covers bad JSON and bad UTF-8
        return None
    if not isinstance(header, dict):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if not ends or 8 + n + max(ends) != size or any(t not in header for t in TENSORS):
        return None
    return header


def shard_metadata(header: dict[str, Any]) -> dict[str, Any]:
    # One metadata key holding JSON: safetensors stores metadata as a map whose key order is
    # not fixed, and one key keeps shard bytes identical from run to run.
    return json.loads(header.get("__metadata__", {}).get("eagle3", "{}"))


def shard_done(out_dir: Path, k: int, ids: list[str], tokens: int,
               facts: dict[str, Any]) -> dict[str, Any] | None:
    """The index entry of shard k if the shard on disk is whole and is exactly these samples
    made with these facts (size, sha256, header, ids); None when it must be (re)done."""
    path, entry_path = out_dir / shard_name(k), out_dir / entry_name(k)
    if not (path.is_file() and entry_path.is_file()):
        return None
    try:
        entry = json.loads(entry_path.read_text())
    except ValueError:
        return None
    if not isinstance(entry, dict) or entry.get("bytes") != path.stat().st_size \
            or entry.get("samples") != len(ids) or entry.get("tokens") != tokens:
        return None
    header = read_shard_header(path)
    if header is None or header["input_ids"]["shape"] != [tokens]:
        return None
    try:
        meta = shard_metadata(header)
    except ValueError:
        return None
    if meta.get("format") != FORMAT or meta.get("ids") != ids \
            or any(meta.get(key) != v for key, v in facts.items()):
        return None
    # The hash catches damage inside the data that keeps the size (a bad copy, a bad disk).
    if file_sha256(path) != entry.get("sha256"):
        return None
    return entry


def write_shard(out_dir: Path, k: int, ids: list[str], input_ids: list[list[int]],
                loss_mask: list[list[int]], states: list[dict[str, torch.Tensor]],
                facts: dict[str, Any]) -> dict[str, Any]:
    """Write shard k (fsynced, atomically) and then its index entry; return the entry."""
    from safetensors.torch import save_file

    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "input_ids": torch.tensor([t for x in input_ids for t in x], dtype=torch.int64),
        "loss_mask": torch.tensor([m for x in loss_mask for m in x], dtype=torch.uint8),
        "offsets": offsets,
    }
    for name in states[0]:
        tensors[name] = torch.cat([s[name] for s in states]).contiguous()
    meta = {"format": FORMAT, "ids": ids, **facts}
    path = out_dir / shard_name(k)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"eagle3": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the rename must never expose bytes still in flight
        digest = file_sha256(tmp)
    entry = {"file": path.name, "samples": len(ids), "tokens": int(offsets[-1]),
             "bytes": path.stat().st_size, "sha256": digest}
    atomic_write_json(out_dir / entry_name(k), entry)
    return entry


def check_disk(directory: Path, needed: int) -> None:
    """Print the bytes this run will write; refuse when the disk lacks them plus the margin."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(needed * (1 + DISK_MARGIN))
    dist.log0("hidden states will write %d bytes (%.3f GB; %.3f GB with the %d%% margin); "
              "%.3f GB free at %s", needed, needed / 1e9, want / 1e9, int(DISK_MARGIN * 100),
              free / 1e9, probe)
    if free < want:
        raise StageError(f"02_hidden_states needs {want / 1e9:.3f} GB ({needed} bytes + "
                         f"{int(DISK_MARGIN * 100)}% margin) but only {free / 1e9:.3f} GB is "
                         f"free at {probe}: free space, or point run.dir to a larger disk")


# ---------------------------------------------------------------------------------------------
# hf backend: selective loading of the text decoder


def find_text_prefix(names: list[str]) -> str:
    """Checkpoint prefix of the text decoder ("model.", "language_model.model.",
    "model.language_model.", ...): the one whose embed_tokens, norm and layers.0 all exist."""
    keys = set(names)
    cands = [n[:-len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight")]
    cands = [p for p in cands if f"{p}norm.weight" in keys
             and any(n.startswith(f"{p}layers.0.") for n in keys)]
    if not cands:
        raise StageError("verifier checkpoint has no text decoder (`...embed_tokens.weight`, "
                         "`...norm.weight`, `...layers.0.*`): the hf backend cannot load it")
    # A multimodal checkpoint may hold other towers with their own embeddings; the language
    # model is the one named so, else the shortest prefix.
    return sorted(cands, key=lambda p: ("language_model" not in p, len(p)))[0]


def rank_devices(mode: str, ctx: dist.DistContext) -> list[torch.device]:
    """Devices this rank's verifier runs on: one, or (`auto`) its share of the visible GPUs."""
    if mode == "single" or not torch.cuda.is_available():
        return [ctx.device]
    per = torch.cuda.device_count() // ctx.local_world_size
    if per == 0:
        raise StageError(f"hidden_states.device_map=auto: {ctx.local_world_size} ranks per node "
                         f"but only {torch.cuda.device_count()} GPUs; run fewer ranks")
    return [torch.device("cuda", ctx.local_rank * per + i) for i in range(per)]


def text_device_map(num_layers: int, devices: list[torch.device]) -> dict[str, str]:
    """Module -> device for the text decoder: layer i on devices[i * len(devices) // n]."""
    out = {"embed_tokens": str(devices[0]), "rotary_emb": str(devices[0]),
           "norm": str(devices[-1])}
    for i in range(num_layers):
        out[f"layers.{i}"] = str(devices[i * len(devices) // num_layers])
    return out


def load_text_decoder(path: Path, dtype: str, devices: list[torch.device],
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The verifier's text decoder alone (e.g. LlamaModel, DeepseekV3Model).

    Only the decoder's tensors are read, each once, straight to the device of the module that
    uses it: the checkpoint prefix of the text model (`model.`, `language_model.model.`, ...)
    is mapped away, so the lm_head, vision tower and MTP layers are skipped. transformers does
    the loading, so its checkpoint conversions (e.g. fused MoE experts) apply.
    """
    import re

    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    from eagle3.checkpoint import _weight_files

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text_cfg = config.get_text_config(decoder=True)
    prefix = find_text_prefix(list(_weight_files(path)))
    device_map = text_device_map(text_cfg.num_hidden_layers, devices)
    # The skipped tensors would fill the log with an "unexpected keys" report; missing ones
    # are checked below instead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        base, info = AutoModel.from_pretrained(
            path, config=text_cfg, dtype=getattr(torch, dtype), device_map=device_map,
            key_mapping={f"^{re.escape(prefix)}": ""}, trust_remote_code=trust_remote_code,
            output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise StageError(f"verifier checkpoint {path} lacks {prefix}{missing[0]} "
                         f"({len(missing)} decoder tensors missing)")
    return base.eval()


class Capture:
    """Forward hooks that keep HF's `output_hidden_states[j]` for the aux ids, nothing else."""

    def __init__(self, base: Any, aux_ids: list[int]) -> None:
        self.aux_ids = aux_ids
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        layers = getattr(base, "layers", None)
        if layers is None:
            raise StageError(f"verifier {type(base).__name__} has no `layers` list: the hf "
                             f"backend cannot hook its decoder layers")
        for j in aux_ids:
            module = base.embed_tokens if j == 0 else layers[j - 1]
            self.handles.append(module.register_forward_hook(self._hook(j)))

    def _hook(self, j: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.states[j] = output[0] if isinstance(output, tuple) else output
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Index batches over length-sorted samples, each at most `budget` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # Sorted ascending, so sample i is the longest in the batch once added.
        if cur and (len(cur) + 1) * lengths[i] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def capture_samples(base: Any, capture: Capture, input_ids: list[list[int]],
                    batch_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, n_aux*Ht], final [T, Ht]) per sample, in the order given, on the CPU."""
    device = base.embed_tokens.weight.device
    out: list[Any] = [None] * len(input_ids)
    for batch in token_batches([len(x) for x in input_ids], batch_tokens):
        width = max(len(input_ids[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):  # right padding: real tokens never see the padding
            ids[row, :len(input_ids[i])] = torch.tensor(input_ids[i])
            attn[row, :len(input_ids[i])] = 1
        capture.states.clear()
        final = base(input_ids=ids.to(device), attention_mask=attn.to(device),
                     use_cache=False).last_hidden_state.cpu()
        aux = torch.cat([capture.states[j].cpu() for j in capture.aux_ids], dim=-1)
        for row, i in enumerate(batch):
            n = len(input_ids[i])
            out[i] = (aux[row, :n].clone(), final[row, :n].clone())
    return out


# ---------------------------------------------------------------------------------------------
# vllm backend: client of vLLM's extract_hidden_states + ExampleHiddenStatesConnector


def vllm_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """Ids to ask vLLM for: the aux ids plus the last layer (its pre-norm output), ascending,
    which is the order vLLM stacks them in."""
    return sorted(set(aux_ids) | {num_layers})


def vllm_server_args(layer_ids: list[int], storage: Path) -> list[str]:
    """vLLM server arguments that turn it into a hidden-state extractor writing to `storage`."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                 list(layer_ids)}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    # Prefix caching off: every prompt token must run through the verifier in its own request.
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/DeepSeek final RMSNorm, computed as transformers does (fp32, then cast)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * h


class VllmExtractor:
    """Sends each sample to an extraction server; returns (aux, post-norm final) per sample."""

    def __init__(self, url: str, aux_ids: list[int], num_layers: int,
                 norm_weight: torch.Tensor, eps: float, timeout_s: float,
                 concurrency: int) -> None:
        self.url = url.rstrip("/")
        self.aux_ids = aux_ids
        self.layer_ids = vllm_layer_ids(aux_ids, num_layers)
        self.aux_slots = [self.layer_ids.index(j) for j in aux_ids]
        self.final_slot = self.layer_ids.index(num_layers)
        self.norm_weight, self.eps = norm_weight, eps
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.model = self._served_model()

    def _served_model(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=self.timeout_s) as r:
            return json.loads(r.read().decode())["data"][0]["id"]

    def _one(self, sid: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        from eagle3.engines import http_post_json

        try:
            reply = http_post_json(f"{self.url}/v1/completions",
                                   {"model": self.model, "prompt": ids, "max_tokens": 1,
                                    "temperature": 0.0, "return_token_ids": True},
                                   timeout=self.timeout_s)
        except (RuntimeError, OSError) as e:  # HTTP errors, refused connections, timeouts
            raise StageError(f"sample {sid}: vLLM extraction request to {self.url} failed: "
                             f"{e}") from None
        choice = reply["choices"][0]
        if choice.get("prompt_token_ids") not in (None, ids):
            raise StageError(f"sample {sid}: vLLM re-tokenized the prompt (it sent back other "
                             f"prompt_token_ids); the server must take token ids as given")
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise StageError(f"sample {sid}: the vLLM reply has no kv_transfer_params."
                             f"hidden_states_path: the server was not started with "
                             f"extract_hidden_states and ExampleHiddenStatesConnector")
        lock = path + ".lock"
        if os.path.exists(lock):
            # The connector holds LOCK_EX on the lock file until the write is complete.
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
                data = load_file(path)
        else:
            data = load_file(path)
        for p in (path, lock):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
        states, tokens = data["hidden_states"], data["token_ids"]
        if tokens.tolist() != ids:
            raise StageError(f"sample {sid}: vLLM saved hidden states for other tokens "
                             f"({len(tokens)} tokens, expected {len(ids)})")
        if states.dim() != 3 or states.shape[:2] != (len(ids), len(self.layer_ids)):
            raise StageError(f"sample {sid}: vLLM hidden_states shape {list(states.shape)}, "
                             f"expected [{len(ids)}, {len(self.layer_ids)}, hidden]; was the "
                             f"server started with layer ids {self.layer_ids}?")
        aux = states[:, self.aux_slots].reshape(len(ids), -1)
        final = rms_norm(states[:, self.final_slot], self.norm_weight, self.eps)
        return aux, final

    def capture(self, sample_ids: list[str],
                input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, sample_ids, input_ids))


@contextlib.contextmanager
def _vllm_extractor(stage: Stage, aux_ids: list[int], max_len: int) -> Iterator[VllmExtractor]:
    from eagle3 import engines
    from eagle3.checkpoint import read_verifier_tensor

    cfg, hs = stage.cfg, stage.cfg.hidden_states
    info = cfg.verifier_info
    norm = read_verifier_tensor(cfg.verifier_path, "norm")

    def make(url: str) -> VllmExtractor:
        return VllmExtractor(url, aux_ids, info.num_hidden_layers, norm, info.rms_norm_eps,
                             hs.vllm_timeout_s, hs.vllm_concurrency)

    if hs.vllm_url:
        yield make(hs.vllm_url)
        return
    storage = stage.dir / VLLM_STORAGE
    storage.mkdir(parents=True, exist_ok=True)
    args = vllm_server_args(vllm_layer_ids(aux_ids, info.num_hidden_layers), storage)
    # The engine's environment (python, env, startup timeout) is the one stage 06 uses.
    server_cfg = dataclasses.replace(cfg.bench, extra_args=[*hs.vllm_args, *args],
                                     max_model_len=max_len + 1)
    with engines.vllm_server(server_cfg, cfg.verifier_path, stage.dir / "vllm.log") as server:
        yield make(server.url())


# ---------------------------------------------------------------------------------------------
# The stage


def run_extract(stage: Stage) -> None:
    """Run stage 02 for `stage.cfg`, keeping complete shards from an earlier attempt."""
    import pyarrow.compute as pc
    from datasets import load_from_disk

    started = time.time()
    ctx = dist.init()
    cfg, hs = stage.cfg, stage.cfg.hidden_states
    stage.require(1)
    if hs.backend == "vllm" and ctx.distributed:
        raise StageError("hidden_states.backend=vllm runs as one process (the engine is the "
                         "parallel part): start it with python, not torchrun")
    if hs.device_map == "auto" and hs.backend == "vllm":
        raise StageError("hidden_states.device_map applies to the hf backend only; give vLLM "
                         "its parallelism in hidden_states.vllm_args")
    data_dir = stage.upstream(1).dir / "dataset"
    ds = load_from_disk(str(data_dir))
    info = cfg.verifier_info
    aux_ids = list(info.aux_layer_ids)
    hidden, dtype = info.hidden_size, hs.dtype
    out_dir = stage.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        clean_stale_tmp(out_dir)
    dist.barrier()

    all_ids: list[str] = list(ds["id"])
    # Lengths straight from Arrow: materializing every token list would not fit in memory for
    # production datasets.
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_pylist()
    per = hs.shard_samples
    shards = [(k, list(range(s, min(s + per, len(ds)))))
              for k, s in enumerate(range(0, len(ds), per))]
    facts = {"aux_layer_ids": aux_ids, "aux_layer_convention": AUX_CONVENTION,
             "final_state": FINAL_STATE, "dtype": dtype, "hidden_size": hidden,
             "verifier": str(cfg.verifier_path)}
    mine = [(k, rows) for k, rows in shards if k % ctx.world_size == ctx.rank]
    todo = [(k, rows) for k, rows in mine
            if shard_done(out_dir, k, [all_ids[i] for i in rows],
                          sum(lengths[i] for i in rows), facts) is None]
    bpt = bytes_per_token(len(aux_ids), hidden, dtype)
    total_tokens = sum(lengths)
    needed = dist.all_sum(sum(lengths[i] for _, rows in todo for i in rows) * bpt)
    n_todo = dist.all_sum(len(todo))
    dist.log0("%d samples, %d tokens -> %d shards (%d to write), %d B/token "
              "(%d aux x %d hidden, %s): %.3f GB for the whole set", len(ds), total_tokens,
              len(shards), n_todo, bpt, len(aux_ids), hidden, dtype, total_tokens * bpt / 1e9)
    check_disk(out_dir, needed)

    written = 0
    if todo:
        written = _extract_shards(stage, ctx, ds, todo, aux_ids, facts, max(lengths))
    written = dist.all_sum(written)
    dist.barrier()
    if not ctx.is_main:
        return

    entries = []
    for k, rows in shards:
        path = out_dir / entry_name(k)
        if not path.is_file():
            raise StageError(f"{shard_name(k)} was not written (a rank failed?): rerun "
                             f"`python {stage.script} {cfg.source}` to finish it")
        entries.append(json.loads(path.read_text()))
    aux_t, final_t = STORAGE[dtype]
    index = {"format": FORMAT, **facts, "num_aux": len(aux_ids),
             "storage": {"aux": str(aux_t).replace("torch.", ""),
                         "final": str(final_t).replace("torch.", ""),
                         "aux_scale": "float32 [tokens, n_aux]" if dtype == "fp8_e4m3"
                         else None},
             "bytes_per_token": bpt, "num_samples": len(ds), "num_tokens": total_tokens,
             "shards": entries}
    atomic_write_json(out_dir / INDEX, index)
    stage.write_manifest(
        inputs={"01_data": stage.upstream_hash(1), "dataset": str(data_dir)},
        outputs={"index": INDEX, "shards": [e["file"] for e in entries]},
        counts={"samples": len(ds), "tokens": total_tokens, "shards": len(shards),
                "bytes": sum(e["bytes"] for e in entries), "bytes_per_token": bpt,
                "bytes_written_this_run": written, "ranks": ctx.world_size},
        started=started, backend=hs.backend, **facts)


def _extract_shards(stage: Stage, ctx: dist.DistContext, ds: Any, todo: list,
                    aux_ids: list[int], facts: dict[str, Any], max_len: int) -> int:
    """Capture and write this rank's missing shards; return the bytes written."""
    cfg, hs = stage.cfg, stage.cfg.hidden_states
    written, done_tokens, done_samples = 0, 0, 0
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        if hs.backend == "vllm":
            extractor = stack.enter_context(_vllm_extractor(stage, aux_ids, max_len))

            def capture_fn(ids: list[str], input_ids: list[list[int]]) -> list:
                return extractor.capture(ids, input_ids)
        else:
            base = load_text_decoder(cfg.verifier_path, cfg.verifier.dtype,
                                     rank_devices(hs.device_map, ctx),
                                     cfg.verifier.trust_remote_code)
            capture = Capture(base, aux_ids)
            stack.callback(capture.remove)

            def capture_fn(ids: list[str], input_ids: list[list[int]]) -> list:
                return capture_samples(base, capture, input_ids, hs.batch_tokens)
        t0 = time.time()
        for k, rows in todo:
            sub = ds.select(rows)
            ids, input_ids, masks = list(sub["id"]), list(sub["input_ids"]), \
                list(sub["loss_mask"])
            states = []
            for sid, (aux, final) in zip(ids, capture_fn(ids, input_ids)):
                check_finite(sid, k, aux, final, cfg.verifier.dtype)
                states.append(encode(aux, final, hs.dtype, len(aux_ids)))
            written += write_shard(stage.dir, k, ids, input_ids, masks, states, facts)["bytes"]
            done_tokens += sum(len(x) for x in input_ids)
            done_samples += len(ids)
            dt = max(time.time() - t0, 1e-9)
            log.info("rank %d: shard %d written (%d/%d of this rank): %.1f tokens/s, "
                     "%.2f samples/s", ctx.rank, k, todo.index((k, rows)) + 1, len(todo),
                     done_tokens / dt, done_samples / dt)
    return written


# ---------------------------------------------------------------------------------------------
# Reader


def pack(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Greedy groups of samples (in the order of `indices`) of at most `budget` tokens each; a
    longer sample makes a group of its own (the trainer truncates it to the budget)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in indices:
        n = min(lengths[i], budget)
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


class HiddenStates:
    """Random access to the samples of a finished `02_hidden_states/` directory.

    Reads only the requested sample's rows of each tensor (safetensors slices), so a sample
    costs its own bytes, not its shard's. fp8 aux states come back dequantized (float32).
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        index_path = self.dir / INDEX
        if not index_path.is_file():
            raise StageError(f"{self.dir} has no {INDEX}: run "
                             f"`python 02_extract_hidden_states.py CONFIG` to finish stage 02")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") not in READABLE_FORMATS:
            raise StageError(f"{index_path}: unknown format {self.index.get('format')!r}; "
                             f"rerun stage 02 with --restart")
        self._handles: dict[int, Any] = {}
        self._where: list[tuple[int, int]] = []  # sample -> (shard, local index)
        self._offsets: list[list[int]] = []
        self.ids: list[str] = []
        for k, shard in enumerate(self.index["shards"]):
            f = self._open(k)
            meta = json.loads(f.metadata()["eagle3"])
            self.ids.extend(meta["ids"])
            self._offsets.append(f.get_tensor("offsets").tolist())
            self._where.extend((k, i) for i in range(shard["samples"]))

    def _open(self, k: int) -> Any:
        from safetensors import safe_open

        if k not in self._handles:
            self._handles[k] = safe_open(str(self.dir / self.index["shards"][k]["file"]),
                                         framework="pt")
        return self._handles[k]

    @property
    def aux_layer_ids(self) -> list[int]:
        """Aux ids as HF `output_hidden_states` indices."""
        return list(self.index["aux_layer_ids"])

    @property
    def final_is_post_norm(self) -> bool:
        return self.index["final_state"] == FINAL_STATE

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def dtype(self) -> str:
        """Storage dtype: float32, bfloat16 or fp8_e4m3."""
        return str(self.index["dtype"])

    def __len__(self) -> int:
        return len(self._where)

    def num_tokens(self, i: int) -> int:
        k, j = self._where[i]
        return self._offsets[k][j + 1] - self._offsets[k][j]

    @property
    def lengths(self) -> list[int]:
        return [self.num_tokens(i) for i in range(len(self))]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self._where[i]
        s, e = self._offsets[k][j], self._offsets[k][j + 1]
        f = self._open(k)
        aux = f.get_slice("aux")[s:e]
        if aux.dtype == torch.float8_e4m3fn:
            aux = dequantize_fp8(aux, f.get_slice("aux_scale")[s:e])
        return {"input_ids": f.get_slice("input_ids")[s:e].long(),
                "loss_mask": f.get_slice("loss_mask")[s:e].long(),
                "aux": aux,
                "final": f.get_slice("final")[s:e]}

    def pack(self, indices: list[int], budget: int) -> list[list[int]]:
        """Token-budget groups of samples, in the order given (see `pack`)."""
        return pack([self.num_tokens(i) for i in range(len(self))], indices, budget)

    def packed(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Samples concatenated into one row with document boundaries: the per-sample tensors
        plus `doc_ids` [T] (0..len-1), `positions` [T] (restart at 0 per document) and
        `cu_seqlens` [len+1] (document starts, then the total)."""
        samples = [self[i] for i in indices]
        out = {name: torch.cat([s[name] for s in samples]) for name in samples[0]}
        lens = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long)
        out["doc_ids"] = torch.repeat_interleave(torch.arange(len(samples)), lens)
        out["positions"] = torch.cat([torch.arange(int(n)) for n in lens])
        out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        return out
