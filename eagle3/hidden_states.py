"""Stage 02: capture the verifier's aux and final hidden states; the shard writer and reader.

    python 02_extract_hidden_states.py configs/smollm2-135m-cpu.yaml [hidden_states.dtype=float32]

    hs = HiddenStates("runs/smollm2-135m-cpu/02_hidden_states")
    sample = hs[0]   # {"input_ids", "loss_mask", "aux" [T, n_aux*Ht], "final" [T, Ht]}

Backend `hf`: one transformers forward per batch (length-sorted, right-padded, at most
`hidden_states.batch_tokens` padded tokens) with forward hooks on just the decoder layers whose
outputs are needed. Aux ids are HF `output_hidden_states` indices (id j = output of decoder
layer j-1 = input of layer j; 0 = embeddings). An id equal to the layer count captures the last
layer's raw output, pre-norm, as engines do; HF's own `output_hidden_states[-1]` is post-norm,
so only that one index differs from HF. The final state is the base model's
`last_hidden_state`, which is **post final norm** (so `lm_head(final)` are the verifier's
logits); it is never normed again.

Output under `02_hidden_states/`: `shard-NNNNN.safetensors`, each holding
`hidden_states.shard_samples` consecutive samples of the stage-01 dataset (dataset order) as
token-concatenated tensors `input_ids` [N] int64, `loss_mask` [N] uint8, `aux` [N, n_aux*Ht] and
`final` [N, Ht] in `hidden_states.dtype`, `offsets` [samples+1] int64, and the sample ids in the
metadata; then `index.json` and `manifest.json`. Shards are written atomically; a rerun keeps
every complete shard and redoes missing, truncated or damaged ones.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch

from eagle3.runs import Stage, StageError, atomic_path, atomic_write_json, clean_stale_tmp

log = logging.getLogger("eagle3")

FORMAT = "eagle3-hidden-states-v1"
INDEX = "index.json"
AUX_CONVENTION = "hf_output_hidden_states"
FINAL_STATE = "post_norm"
DISK_MARGIN = 0.10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TENSORS = ("input_ids", "loss_mask", "aux", "final", "offsets")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(n_aux: int, hidden: int, dtype: str) -> int:
    """Disk bytes one token takes in a shard: states plus its id (int64) and mask (uint8)."""
    return (n_aux + 1) * hidden * DTYPES[dtype].itemsize + 8 + 1


def read_shard_header(path: Path) -> dict[str, Any] | None:
    """The safetensors header of `path`, or None when the file is truncated or not one.

    Checks that every tensor's data lies inside the file, so a cut-off shard is never taken as
    complete.
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


def _shard_complete(path: Path, ids: list[str], facts: dict[str, Any]) -> bool:
    """True when `path` is a whole shard of exactly these samples, made with these facts."""
    header = read_shard_header(path) if path.is_file() else None
    if header is None:
        return False
    try:
        meta = shard_metadata(header)
    except ValueError:
        return False
    return (meta.get("format") == FORMAT and meta.get("ids") == ids
            and all(meta.get(k) == v for k, v in facts.items()))


# ---------------------------------------------------------------------------------------------
# Capture


def _decoder_layers(base: Any) -> Any:
    layers = getattr(base, "layers", None)
    if layers is None:
        raise StageError(f"verifier {type(base).__name__} has no `layers` list: the hf backend "
                         f"cannot hook its decoder layers")
    return layers


class _Capture:
    """Forward hooks that keep the HF `output_hidden_states[j]` tensors for the aux ids."""

    def __init__(self, base: Any, aux_ids: list[int]) -> None:
        self.aux_ids = aux_ids
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        layers = _decoder_layers(base)
        for j in aux_ids:
            module = base.embed_tokens if j == 0 else layers[j - 1]
            self.handles.append(module.register_forward_hook(self._hook(j)))

    def _hook(self, j: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            self.states[j] = output[0] if isinstance(output, tuple) else output
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _load_verifier(stage: Stage) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM

    cfg = stage.cfg
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        cfg.verifier_path, dtype=getattr(torch, cfg.verifier.dtype),
        trust_remote_code=cfg.verifier.trust_remote_code).to(device)
    model.eval()
    return model, model.get_decoder(), device


def _token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Index batches over length-sorted samples, each at most `budget` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur = [], []
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
def capture_samples(base: Any, capture: _Capture, device: str, input_ids: list[list[int]],
                    batch_tokens: int, store: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """(aux [T, n_aux*Ht], final [T, Ht]) per sample, in the order given, on the CPU."""
    out: list[Any] = [None] * len(input_ids)
    for batch in _token_batches([len(x) for x in input_ids], batch_tokens):
        width = max(len(input_ids[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):  # right padding: real tokens never see the padding
            ids[row, :len(input_ids[i])] = torch.tensor(input_ids[i])
            attn[row, :len(input_ids[i])] = 1
        capture.states.clear()
        final = base(input_ids=ids.to(device), attention_mask=attn.to(device),
                     use_cache=False).last_hidden_state
        aux = torch.cat([capture.states[j] for j in capture.aux_ids], dim=-1)
        for row, i in enumerate(batch):
            n = len(input_ids[i])
            out[i] = (aux[row, :n].to("cpu", store), final[row, :n].to("cpu", store))
    return out


def _write_shard(path: Path, ids: list[str], input_ids: list[list[int]],
                 loss_mask: list[list[int]], states: list[tuple[torch.Tensor, ...]],
                 facts: dict[str, Any]) -> int:
    from safetensors.torch import save_file

    lengths = [len(x) for x in input_ids]
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "input_ids": torch.tensor([t for x in input_ids for t in x], dtype=torch.int64),
        "loss_mask": torch.tensor([m for x in loss_mask for m in x], dtype=torch.uint8),
        "aux": torch.cat([s[0] for s in states]).contiguous(),
        "final": torch.cat([s[1] for s in states]).contiguous(),
        "offsets": offsets,
    }
    meta = {"format": FORMAT, "ids": ids, **facts}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"eagle3": json.dumps(meta)})
    return path.stat().st_size


def _check_disk(directory: Path, needed: int) -> None:
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(needed * (1 + DISK_MARGIN))
    log.info("hidden states need %.3f GB on disk (%.3f GB with the %d%% margin); %.3f GB free "
             "at %s", needed / 1e9, want / 1e9, int(DISK_MARGIN * 100), free / 1e9, probe)
    if free < want:
        raise StageError(f"02_hidden_states needs {want / 1e9:.3f} GB ({needed} bytes + "
                         f"{int(DISK_MARGIN * 100)}% margin) but only {free / 1e9:.3f} GB is "
                         f"free at {probe}: free space, or point run.dir to a larger disk")


def run_extract(stage: Stage) -> None:
    """Run stage 02 for `stage.cfg`, keeping complete shards from an earlier attempt."""
    from datasets import load_from_disk

    started = time.time()
    cfg = stage.cfg
    stage.require(1)
    data_dir = stage.upstream(1).dir / "dataset"
    ds = load_from_disk(str(data_dir))
    info = cfg.verifier_info
    aux_ids = list(info.aux_layer_ids)
    hidden, dtype = info.hidden_size, cfg.hidden_states.dtype
    out_dir = stage.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out_dir)

    all_ids: list[str] = list(ds["id"])
    # Lengths straight from Arrow: materializing every token list would not fit in memory for
    # production datasets.
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_pylist()
    per = cfg.hidden_states.shard_samples
    shards = [(k, list(range(s, min(s + per, len(ds)))))
              for k, s in enumerate(range(0, len(ds), per))]
    facts = {"aux_layer_ids": aux_ids, "aux_layer_convention": AUX_CONVENTION,
             "final_state": FINAL_STATE, "dtype": dtype, "hidden_size": hidden,
             "verifier": str(cfg.verifier_path)}
    todo = [(k, rows) for k, rows in shards
            if not _shard_complete(out_dir / shard_name(k), [all_ids[i] for i in rows], facts)]
    bpt = bytes_per_token(len(aux_ids), hidden, dtype)
    total_tokens = sum(lengths)
    needed = sum(lengths[i] for _, rows in todo for i in rows) * bpt
    log.info("%d samples, %d tokens -> %d shards (%d to write), %.3f GB in all (%d B/token)",
             len(ds), total_tokens, len(shards), len(todo), total_tokens * bpt / 1e9, bpt)
    _check_disk(out_dir, needed)

    written = 0
    if todo:
        model, base, device = _load_verifier(stage)
        capture = _Capture(base, aux_ids)
        t0, done_tokens = time.time(), 0
        try:
            for k, rows in todo:
                sub = ds.select(rows)
                ids, input_ids, masks = list(sub["id"]), list(sub["input_ids"]), \
                    list(sub["loss_mask"])
                states = capture_samples(base, capture, device, input_ids,
                                         cfg.hidden_states.batch_tokens, DTYPES[dtype])
                for sid, (aux, final) in zip(ids, states):
                    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
                        raise StageError(f"non-finite hidden state for sample {sid} (shard {k}):"
                                         f" the verifier overflows in {cfg.verifier.dtype}; try "
                                         f"verifier.dtype=float32 or drop the sample")
                written += _write_shard(out_dir / shard_name(k), ids, input_ids, masks, states,
                                        facts)
                done_tokens += sum(len(x) for x in input_ids)
                dt = max(time.time() - t0, 1e-9)
                log.info("shard %d/%d written: %.1f tokens/s, %.2f samples/s", k + 1,
                         len(shards), done_tokens / dt,
                         sum(len(r) for kk, r in todo if kk <= k) / dt)
        finally:
            capture.remove()

    index = {"format": FORMAT, **facts, "num_aux": len(aux_ids),
             "num_samples": len(ds), "num_tokens": total_tokens,
             "shards": [{"file": shard_name(k), "samples": len(rows),
                         "tokens": sum(lengths[i] for i in rows)} for k, rows in shards]}
    atomic_write_json(out_dir / INDEX, index)
    total_bytes = sum((out_dir / shard_name(k)).stat().st_size for k, _ in shards)
    stage.write_manifest(
        inputs={"01_data": stage.upstream_hash(1), "dataset": str(data_dir)},
        outputs={"index": INDEX, "shards": [shard_name(k) for k, _ in shards]},
        counts={"samples": len(ds), "tokens": total_tokens, "shards": len(shards),
                "bytes": total_bytes, "bytes_written_this_run": written},
        started=started, **facts)


# ---------------------------------------------------------------------------------------------
# Reader


class HiddenStates:
    """Random access to the samples of a finished `02_hidden_states/` directory.

    Reads only the requested sample's rows of each tensor (safetensors slices), so a sample
    costs its own bytes, not its shard's.
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        index_path = self.dir / INDEX
        if not index_path.is_file():
            raise StageError(f"{self.dir} has no {INDEX}: run "
                             f"`python 02_extract_hidden_states.py CONFIG` to finish stage 02")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
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

    def __len__(self) -> int:
        return len(self._where)

    def num_tokens(self, i: int) -> int:
        k, j = self._where[i]
        return self._offsets[k][j + 1] - self._offsets[k][j]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self._where[i]
        s, e = self._offsets[k][j], self._offsets[k][j + 1]
        f = self._open(k)
        return {"input_ids": f.get_slice("input_ids")[s:e].long(),
                "loss_mask": f.get_slice("loss_mask")[s:e].long(),
                "aux": f.get_slice("aux")[s:e],
                "final": f.get_slice("final")[s:e]}
