"""Stage 02: capture the verifier's aux and final hidden states into shards (eagle3.shards).

    python 02_extract_hidden_states.py configs/smollm2-135m-cpu.yaml [hidden_states.dtype=fp8_e4m3]
    torchrun --nproc-per-node 8 02_extract_hidden_states.py CONFIG      # hf backend, 8 ranks
    python 02_extract_hidden_states.py configs/kimi-k2.5.yaml           # vllm backend (Kimi)

Aux ids are HF `output_hidden_states` indices and the final state is stored post-norm
(eagle3.shards). An aux id equal to the layer count is the last layer's raw, pre-norm output
(as engines capture it): the only index where it differs from HF's `output_hidden_states[-1]`.

Backend `hf` (any verifier that fits in this process's devices): only the text decoder is
built (for a multimodal wrapper such as Kimi-K2.5, the model under `text_config`) and only its
weights are read, each once, straight onto the device that runs it: no lm_head, vision tower
or MTP layers. Forward hooks keep just the aux layers' outputs. Samples of a shard are
length-sorted and cut into batches of at most `hidden_states.batch_tokens` padded tokens,
right-padded, and each sample is sliced back to its own length, so padding is never written.
With a verifier elsewhere than this CPU (vLLM, a GPU), a writer thread writes, fsyncs and
hashes each shard while the next one is captured. Under torchrun each rank writes the shards
`k` with `k % world_size == rank`; a shard's bytes do not depend on the rank count.
`hidden_states.device_map=auto` splits the decoder layers over this rank's share of the
visible GPUs, for a verifier larger than one device.

Backend `vllm` (the Kimi-K2.5 path: a 1T-parameter INT4 MoE that only an engine holds on an
8-GPU node): a vLLM server is started from `hidden_states.server` (or reached at
`hidden_states.server_urls`, several spreading the requests) with
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
must see the server's storage directory (same node). vLLM 0.32's CPU build cannot run this
(docs/engines.md); the client is tested against responses in vLLM's exact format. On a new
node or vLLM version, first run a handful of samples (data.num_samples=4): vLLM's hidden-state
cache is an MLA-typed KV spec and its grouping next to MLA verifiers has had bugs (vLLM
#53243 / PR #53074 for DeepSeek-V4); the connector stops with "MLA verifiers are unsupported"
when it cannot isolate the group.

The bytes to write are printed before starting, and a disk without them plus 10% refuses to
start. `index.json` and `manifest.json` are written last, by rank 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import shutil
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from eagle3 import dist
from eagle3.runs import Stage, StageError, atomic_write_json, clean_stale_tmp, file_records
from eagle3.shards import (AUX_CONVENTION, FINAL_STATE, FORMAT, INDEX, STORAGE,
                           bytes_per_token, encode, entry_name, shard_done, shard_name,
                           write_shard)
from eagle3.config import ServerConfig
from eagle3.cpu import verifier_leaves_this_cpu_free
from eagle3.engines import base_url, http_post_json, root_cause, served_model, start_server
from eagle3.verifier import load_final_norm, load_text_decoder

log = logging.getLogger("eagle3")

DISK_MARGIN = 0.10
VLLM_STORAGE = ".vllm_hidden_states"


def check_finite(sample_id: str, where: str, aux: torch.Tensor, final: torch.Tensor,
                 verifier_dtype: str) -> None:
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise StageError(f"non-finite hidden state for sample {sample_id} ({where}): the "
                         f"verifier overflows in {verifier_dtype}; try verifier.dtype=float32 "
                         f"or drop the sample")


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


def rank_devices(mode: str, ctx: dist.DistContext) -> list[torch.device]:
    """Devices this rank's verifier runs on: one, or (`auto`) its share of the visible GPUs."""
    if mode == "single" or not torch.cuda.is_available():
        return [ctx.device]
    per = torch.cuda.device_count() // ctx.local_world_size
    if per == 0:
        raise StageError(f"hidden_states.device_map=auto: {ctx.local_world_size} ranks per node "
                         f"but only {torch.cuda.device_count()} GPUs; run fewer ranks")
    return [torch.device("cuda", ctx.local_rank * per + i) for i in range(per)]


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
            # Id j (>= 1, checked by the config) is the output of decoder layer j - 1.
            self.handles.append(layers[j - 1].register_forward_hook(self._hook(j)))

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


class VllmExtractor:
    """Sends each sample to an extraction server (the i-th of a call to server i mod n); returns
    (aux, post-norm final) per sample."""

    def __init__(self, urls: list[str], aux_ids: list[int], num_layers: int,
                 norm: torch.nn.Module, server: ServerConfig, concurrency: int,
                 log_path: Path | None = None) -> None:
        self.urls = [base_url(u) for u in urls]
        self.log_path = log_path
        """The log of the server this stage started (None for given server_urls): a failed
        request quotes its root cause, which an HTTP 500 does not carry."""
        self.aux_ids = aux_ids
        self.layer_ids = vllm_layer_ids(aux_ids, num_layers)
        self.aux_slots = [self.layer_ids.index(j) for j in aux_ids]
        self.final_slot = self.layer_ids.index(num_layers)
        self.norm = norm
        """The verifier's own final norm (eagle3.verifier.load_final_norm), applied in the
        verifier's dtype as its forward does."""
        self.norm_dtype = next(norm.parameters()).dtype
        self.server, self.concurrency = server, concurrency
        self.models = [served_model(u, server) for u in self.urls]

    def _one(self, n: int, sid: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        url, model = self.urls[n % len(self.urls)], self.models[n % len(self.urls)]
        try:
            reply = http_post_json(f"{url}/v1/completions",
                                   {"model": model, "prompt": ids, "max_tokens": 1,
                                    "temperature": 0.0, "return_token_ids": True},
                                   self.server)
        except StageError as e:
            cause = root_cause(self.log_path) if self.log_path else None
            raise StageError(f"sample {sid}: vLLM extraction request failed: {e}"
                             + (f"; root cause in {self.log_path}: {cause}" if cause else "")
                             ) from None
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
        with torch.no_grad():
            final = self.norm(states[:, self.final_slot].to(self.norm_dtype))
        return aux, final

    def capture(self, sample_ids: list[str],
                input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, range(len(sample_ids)), sample_ids, input_ids))


def rank_servers(urls: list[str], ctx: dist.DistContext) -> list[str]:
    """The extraction servers of this rank: every world_size-th from its rank, or one shared
    when there are fewer servers than ranks."""
    return urls[ctx.rank::ctx.world_size] or [urls[ctx.rank % len(urls)]]


@contextlib.contextmanager
def _vllm_extractor(stage: Stage, ctx: dist.DistContext, aux_ids: list[int],
                    max_len: int) -> Iterator[VllmExtractor]:
    cfg, hs = stage.cfg, stage.cfg.hidden_states
    info = cfg.verifier_info
    norm = load_final_norm(cfg.verifier_path, cfg.verifier.dtype, cfg.verifier.trust_remote_code)

    def make(urls: list[str], log_path: Path | None = None) -> VllmExtractor:
        return VllmExtractor(urls, aux_ids, info.num_hidden_layers, norm, hs.server,
                             hs.concurrency, log_path)

    if hs.server_urls:
        yield make(rank_servers(list(hs.server_urls), ctx))
        return
    if ctx.distributed:
        raise StageError("hidden_states.backend=vllm under torchrun needs running extraction "
                         "servers: start them (python -m eagle3.plan prints the command) and "
                         "list them in hidden_states.server_urls")
    storage = stage.dir / VLLM_STORAGE
    storage.mkdir(parents=True, exist_ok=True)
    args = vllm_server_args(vllm_layer_ids(aux_ids, info.num_hidden_layers), storage)
    with start_server("vllm", cfg, hs.server, "hidden_states.server", stage.dir / "vllm.log",
                      max_model_len=hs.server.max_model_len or max_len + 1,
                      args=args) as server:
        yield make([server.url()], server.log_path)


# ---------------------------------------------------------------------------------------------
# The stage


def run_extract(stage: Stage) -> None:
    """Run stage 02 for `stage.cfg`, keeping complete shards from an earlier attempt."""
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
                         "its parallelism in hidden_states.server.extra_args")
    ds = load_from_disk(str(stage.upstream(1).dir / "dataset"))
    stage.dir.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        clean_stale_tmp(stage.dir)
    dist.barrier()
    plan = _plan(stage, ctx, ds)
    # The measure set first: it is small, and a base drafter whose aux ids name layers the
    # verifier cannot capture (or a capture server that will not start with them) then fails
    # in minutes, not after the full extraction.
    if ctx.is_main and cfg.measures_base:
        _extract_measure_set(stage, ctx, ds, plan)
    dist.barrier()
    if hs.mode == "stream":
        if ctx.is_main:
            _store_reference(stage, ctx, ds, plan, STREAM_CHECK_DIR,
                             list(range(min(hs.check_samples, len(ds)))),
                             list(cfg.verifier_info.aux_layer_ids))
            _finish_stream(stage, plan, started)
        dist.barrier()
        return
    written = _extract_shards(stage, ctx, ds, plan) if plan.todo else 0
    written = dist.all_sum(written)
    dist.barrier()
    if ctx.is_main:
        _finish(stage, plan, written, ctx.world_size, started)


@dataclass
class _Plan:
    shards: list[tuple[int, list[int]]]
    """(shard index, dataset rows) of every shard."""
    todo: list[tuple[int, list[int]]]
    """This rank's shards that are not done yet."""
    facts: dict[str, Any]
    """What every shard records and must match to be kept."""
    lengths: list[int]
    bytes_per_token: int


def _plan(stage: Stage, ctx: dist.DistContext, ds: Any) -> _Plan:
    """Which shards exist, which this rank still has to write, and the disk they need."""
    import pyarrow.compute as pc

    cfg, hs = stage.cfg, stage.cfg.hidden_states
    info = cfg.verifier_info
    aux_ids = list(info.aux_layer_ids)
    ids: list[str] = list(ds["id"])
    # Lengths straight from Arrow: materializing every token list would not fit in memory for
    # production datasets.
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_pylist()
    facts = {"aux_layer_ids": aux_ids, "aux_layer_convention": AUX_CONVENTION,
             "final_state": FINAL_STATE, "dtype": hs.dtype, "hidden_size": info.hidden_size,
             "verifier": str(cfg.verifier_path), "backend": hs.backend}
    bpt = bytes_per_token(len(aux_ids), info.hidden_size, hs.dtype)
    total = sum(lengths)
    if hs.mode == "stream":
        # Only the reference samples (and the measure set) are stored.
        stage.needs_bytes = sum(lengths[:hs.check_samples]) * bpt
        dist.log0("stream mode: %d samples, %d tokens; their states (%.3f GB at %d B/token, "
                  "%s) are computed while stage 04 trains, never stored", len(ds), total,
                  total * bpt / 1e9, bpt, hs.dtype)
        check_disk(stage.dir, stage.needs_bytes)
        return _Plan([], [], facts, lengths, bpt)
    per = hs.shard_samples
    shards = [(k, list(range(s, min(s + per, len(ds)))))
              for k, s in enumerate(range(0, len(ds), per))]
    todo = [(k, rows) for k, rows in shards if k % ctx.world_size == ctx.rank
            and shard_done(stage.dir, k, [ids[i] for i in rows],
                           sum(lengths[i] for i in rows), facts) is None]
    needed = dist.all_sum(sum(lengths[i] for _, rows in todo for i in rows) * bpt)
    stage.needs_bytes = needed
    dist.log0("%d samples, %d tokens -> %d shards (%d to write), %d B/token "
              "(%d aux x %d hidden, %s): %.3f GB for the whole set", len(ds), total,
              len(shards), dist.all_sum(len(todo)), bpt, len(aux_ids), info.hidden_size,
              hs.dtype, total * bpt / 1e9)
    check_disk(stage.dir, needed)
    return _Plan(shards, todo, facts, lengths, bpt)


MEASURE_DIR = "measure"
STREAM_CHECK_DIR = "stream_check"


def measure_layer_ids(cfg: Any) -> list[int]:
    """Every layer some reading of the base drafter's written aux ids names (eagle3.base_drafter
    `candidate_aux_ids`), plus our own ids: what `train.base_aux_convention=measure` needs."""
    from eagle3.base_drafter import candidate_aux_ids, written_aux_ids

    info = cfg.verifier_info
    written = written_aux_ids(cfg.train.finetune_from)
    if written is None:
        raise StageError(f"base drafter {cfg.train.finetune_from} writes no aux ids: nothing to "
                         f"measure; set train.base_aux_convention=as_is")
    ids = {i for cand in candidate_aux_ids(written, info.num_hidden_layers).values()
           for i in cand}
    return sorted(ids | set(info.aux_layer_ids))


def _extract_measure_set(stage: Stage, ctx: dist.DistContext, ds: Any, plan: _Plan) -> None:
    """`02_hidden_states/measure/`: the first `train.measure_samples` samples with the aux states
    of every candidate layer."""
    _store_reference(stage, ctx, ds, plan, MEASURE_DIR,
                     list(range(min(stage.cfg.train.measure_samples, len(ds)))),
                     measure_layer_ids(stage.cfg))


def _store_reference(stage: Stage, ctx: dist.DistContext, ds: Any, plan: _Plan, name: str,
                     rows: list[int], aux_ids: list[int]) -> None:
    """`02_hidden_states/<name>/`: dataset `rows` with the aux states of `aux_ids`, captured as
    one group and written as one shard with its index (kept when already complete)."""
    cfg = stage.cfg
    facts = {**plan.facts, "aux_layer_ids": aux_ids}
    out = stage.dir / name
    out.mkdir(exist_ok=True)
    sub = ds.select(rows)
    sample_ids, input_ids = list(sub["id"]), list(sub["input_ids"])
    if shard_done(out, 0, sample_ids, sum(plan.lengths[i] for i in rows), facts) is None:
        ref_cfg = dataclasses.replace(cfg, verifier=dataclasses.replace(
            cfg.verifier, aux_layer_ids=aux_ids))
        with capture_backend(Stage(ref_cfg, 2), ctx, max(plan.lengths)) as capture_fn:
            states = []
            for sid, (aux, final) in zip(sample_ids, capture_fn(sample_ids, input_ids)):
                check_finite(sid, name, aux, final, cfg.verifier.dtype)
                states.append(encode(aux, final, cfg.hidden_states.dtype, len(aux_ids)))
        write_shard(out, 0, sample_ids, input_ids, list(sub["loss_mask"]), states, facts)
    entry = json.loads((out / entry_name(0)).read_text())
    atomic_write_json(out / INDEX, {"format": FORMAT, **facts, "num_aux": len(aux_ids),
                                    "num_samples": len(rows), "shards": [entry]})
    log.info("%s: %d samples with aux layers %s -> %s", name, len(rows), aux_ids, out)


def _finish_stream(stage: Stage, plan: _Plan, started: float) -> None:
    """Stream mode: index.json names the mode and the reference set; nothing else is stored."""
    n_samples, n_tokens = len(plan.lengths), sum(plan.lengths)
    index = {"format": FORMAT, "mode": "stream", **plan.facts,
             "num_aux": len(plan.facts["aux_layer_ids"]),
             "bytes_per_token": plan.bytes_per_token, "num_samples": n_samples,
             "num_tokens": n_tokens, "check": STREAM_CHECK_DIR}
    atomic_write_json(stage.dir / INDEX, index)
    files = file_records(stage.dir, [stage.dir / INDEX, stage.dir / STREAM_CHECK_DIR] + (
        [stage.dir / MEASURE_DIR] if stage.cfg.measures_base else []))
    stage.write_manifest(
        inputs={"01_data": stage.upstream_hash(1)},
        outputs={"index": INDEX, "check": STREAM_CHECK_DIR},
        counts={"samples": n_samples, "tokens": n_tokens, "shards": 0,
                "bytes": sum(r["bytes"] for r in files.values()),
                "bytes_per_token": plan.bytes_per_token,
                "bytes_if_stored": n_tokens * plan.bytes_per_token},
        files=files, started=started, mode="stream", **plan.facts)


def _finish(stage: Stage, plan: _Plan, written: int, ranks: int, started: float) -> None:
    """index.json and the manifest, once every shard's entry is there (rank 0)."""
    entries = []
    for k, _ in plan.shards:
        path = stage.dir / entry_name(k)
        if not path.is_file():
            raise StageError(f"{shard_name(k)} was not written (a rank failed?): rerun "
                             f"`{stage.command()}` to finish it")
        entries.append(json.loads(path.read_text()))
    aux_t, final_t = STORAGE[plan.facts["dtype"]]
    n_samples, n_tokens = len(plan.lengths), sum(plan.lengths)
    index = {"format": FORMAT, **plan.facts, "num_aux": len(plan.facts["aux_layer_ids"]),
             "storage": {"aux": str(aux_t).removeprefix("torch."),
                         "final": str(final_t).removeprefix("torch."),
                         "aux_scale": "float32 [tokens, n_aux]"
                         if plan.facts["dtype"] == "fp8_e4m3" else None},
             "bytes_per_token": plan.bytes_per_token, "num_samples": n_samples,
             "num_tokens": n_tokens, "shards": entries}
    atomic_write_json(stage.dir / INDEX, index)
    # The shards' records are the ones computed when each was written (no second hash pass).
    files = {e["file"]: {"bytes": e["bytes"], "sha256": e["sha256"]} for e in entries}
    files |= file_records(stage.dir, [stage.dir / INDEX] + (
        [stage.dir / MEASURE_DIR] if stage.cfg.measures_base else []))
    stage.write_manifest(
        inputs={"01_data": stage.upstream_hash(1)},
        outputs={"index": INDEX, "shards": [e["file"] for e in entries]},
        counts={"samples": n_samples, "tokens": n_tokens, "shards": len(plan.shards),
                "bytes": sum(e["bytes"] for e in entries),
                "bytes_per_token": plan.bytes_per_token, "bytes_written_this_run": written,
                "ranks": ranks},
        files=files, started=started, **plan.facts)


@contextlib.contextmanager
def capture_backend(stage: Stage, ctx: dist.DistContext,
                     max_len: int) -> Iterator[Callable[[list[str], list[list[int]]], list]]:
    """A function (sample ids, token ids) -> [(aux, final)] of the configured backend."""
    cfg, hs = stage.cfg, stage.cfg.hidden_states
    aux_ids = list(cfg.verifier_info.aux_layer_ids)
    if hs.backend == "vllm":
        with _vllm_extractor(stage, ctx, aux_ids, max_len) as extractor:
            yield extractor.capture
        return
    base = load_text_decoder(cfg.verifier_path, cfg.verifier.dtype,
                             rank_devices(hs.device_map, ctx), cfg.verifier.trust_remote_code)
    capture = Capture(base, aux_ids)
    try:
        yield lambda ids, input_ids: capture_samples(base, capture, input_ids, hs.batch_tokens)
    finally:
        capture.remove()


def _extract_shards(stage: Stage, ctx: dist.DistContext, ds: Any, plan: _Plan) -> int:
    """Capture and write this rank's missing shards; return the bytes written.

    When the verifier runs elsewhere than this process's CPU (given servers, or a GPU), a
    shard is written, fsynced and hashed by a writer thread while the next one is captured (the
    verifier never waits on the disk); at most one shard waits to be written, so memory holds
    the states of the shard being captured and of the one being written (with its
    concatenated copy while `write_shard` assembles it). On this CPU each write follows its capture
    (`cpu.verifier_leaves_this_cpu_free`). Each shard is atomic on its own: a crash loses at
    most the shards in flight, which a rerun redoes.
    """
    cfg, hs = stage.cfg, stage.cfg.hidden_states
    server = None if hs.backend != "vllm" else "given" if hs.server_urls else "started"
    overlap = verifier_leaves_this_cpu_free(server, ctx.device)
    n_aux = len(plan.facts["aux_layer_ids"])
    written, done_tokens, done_samples = 0, 0, 0
    t0 = 0.0  # set once the verifier is up: the logged rate is extraction's, not its load's

    def write(n: int, k: int, ids: list[str], input_ids: list[list[int]],
              loss_mask: list[list[int]], states: list[dict[str, torch.Tensor]]) -> int:
        nonlocal done_tokens, done_samples
        nbytes = write_shard(stage.dir, k, ids, input_ids, loss_mask, states,
                             plan.facts)["bytes"]
        done_tokens += sum(len(x) for x in input_ids)
        done_samples += len(ids)
        dt = max(time.time() - t0, 1e-9)
        log.info("rank %d: shard %d written (%d/%d of this rank): %.1f tokens/s, "
                 "%.2f samples/s", ctx.rank, k, n, len(plan.todo), done_tokens / dt,
                 done_samples / dt)
        return nbytes

    with capture_backend(stage, ctx, max(plan.lengths)) as capture_fn, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as pool:
        t0 = time.time()
        pending: concurrent.futures.Future | None = None
        for n, (k, rows) in enumerate(plan.todo, 1):
            sub = ds.select(rows)
            ids, input_ids = list(sub["id"]), list(sub["input_ids"])
            states = []
            for sid, (aux, final) in zip(ids, capture_fn(ids, input_ids)):
                check_finite(sid, shard_name(k), aux, final, cfg.verifier.dtype)
                states.append(encode(aux, final, hs.dtype, n_aux))
            if pending is not None:
                written += pending.result()  # a failed write stops the stage here
            pending = pool.submit(write, n, k, ids, input_ids, list(sub["loss_mask"]), states)
            if not overlap:
                written += pending.result()
                pending = None
        if pending is not None:
            written += pending.result()
    return written
