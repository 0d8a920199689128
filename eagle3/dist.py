"""torchrun process setup shared by the stages that run data-parallel (02 extraction, 04 training).

    torchrun --nproc-per-node 8 02_extract_hidden_states.py configs/kimi-k2.5.yaml
    ctx = dist.init()            # world_size 1 (plain `python`) is the normal case
    dist.log0("only rank 0 prints this")

`init()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
starts the process group once (NCCL on CUDA, gloo on CPU) and returns who this process is and
which device it owns. Work is split with `items[ctx.rank::ctx.world_size]`; only rank 0 writes
shared files and logs.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

log = logging.getLogger("eagle3")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class DeviceError(RuntimeError):
    """The devices this process was asked to use are not there (a one-line message)."""


def cuda_shortfall(local_world: int) -> str | None:
    """Why `local_world` ranks cannot each own a GPU here, or None when they can."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else
                                                 ", a CPU-only build")
        return (f"this torch ({build}) sees no GPU: install a CUDA build of torch (README, "
                f"'GPU environment') or set train.device=cpu")
    if local_world > n:
        return (f"{local_world} ranks on this node but torch sees {n} GPU(s): start torchrun "
                f"with --nproc-per-node {n} or fewer, or check CUDA_VISIBLE_DEVICES")
    return None


def init(device: str = "auto", timeout_min: float = 30.0) -> DistContext:
    """Join the torchrun job (if any) and return this process's rank, world size and device.
    `device` (`train.device`): auto | cuda | cpu; `cuda` raises `DeviceError` when each local
    rank cannot have a GPU. The process group's collectives time out after `timeout_min`."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if device == "cuda" and (why := cuda_shortfall(local_world)):
        raise DeviceError(f"train.device=cuda, but {why}")
    if device != "cpu" and torch.cuda.is_available():
        target = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(target)
    else:
        target = torch.device("cpu")
    if world > 1 and not torch_dist.is_initialized():
        backend = "nccl" if target.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                      timeout=datetime.timedelta(minutes=timeout_min),
                                      device_id=target if target.type == "cuda" else None)
    return DistContext(rank, world, local_rank, local_world, target)


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of `values` over all ranks (a collective; one process: unchanged).
    float64, so integer counts up to 2**53 stay exact."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if torch_dist.get_backend() == "nccl":
        t = t.cuda()
    torch_dist.all_reduce(t)
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all ranks, on its own device (no host sync; one process: `t`)."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return t
    t = t.clone()
    torch_dist.all_reduce(t)
    return t


def log0(msg: str, *args: object) -> None:
    """logging.info on rank 0 only."""
    if _env_int("RANK", 0) == 0:
        log.info(msg, *args)


def destroy() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def all_sum(value: int) -> int:
    """Sum of `value` over all ranks (a collective; one-process: `value`)."""
    return int(all_reduce_sum([float(value)])[0])


# ---------------------------------------------------------------------------------------------
# FSDP (fully_shard): parameters, gradients and optimizer state split over the ranks.
#
# A checkpoint always holds full, unsharded tensors in the single-process layout, so a run
# written under FSDP resumes under DDP (same world size) and vice versa, and the exported
# drafter never depends on how it was trained.


def wrap(objective: torch.nn.Module, parallel: str, ctx: DistContext) -> torch.nn.Module:
    """The objective as training runs it: as is (one process), replicated (`ddp`) or sharded
    (`fsdp`)."""
    if parallel == "fsdp":
        return fully_shard(objective)
    if parallel == "ddp":
        # d2t/t2d are the only buffers and never change: no per-forward buffer broadcast.
        return torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            broadcast_buffers=False)
    return objective


def grad_sync(objective: torch.nn.Module, sync: bool) -> Any:
    """Context for one micro-batch's backward: reduce gradients over ranks only when `sync`
    (the step's last micro-batch); accumulate locally before."""
    if isinstance(objective, torch.nn.parallel.DistributedDataParallel) and not sync:
        return objective.no_sync()
    if hasattr(objective, "set_requires_gradient_sync"):  # FSDP2
        objective.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def gather_objects(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (a collective; one process: [obj])."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def fully_shard(objective: torch.nn.Module) -> torch.nn.Module:
    """FSDP2-shard `objective` as one group: its weights are gathered for the forward and
    backward, and gradients and AdamW moments (12 of the ~16 bytes per trainable parameter)
    stay sharded. Not one group per decoder layer: TTT calls each layer once per step within a
    forward, and FSDP2's per-module post-backward reduce-scatter then misses the gradient of
    the other calls (measured: wrong gradients at ttt_steps > 1, exact at 1)."""
    from torch.distributed import fsdp
    fsdp.fully_shard(objective)
    return objective


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded copies of a (possibly FSDP-sharded) state dict, a collective when sharded.
    Gathered tensors go to host memory one by one: the device never holds the whole state."""
    return {k: v.full_tensor().cpu() if _is_dtensor(v) else v for k, v in state.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with every sharded moment gathered (a collective under FSDP)."""
    sd = optimizer.state_dict()
    sd["state"] = {i: full_tensors(s) for i, s in sd["state"].items()}
    return sd


def load_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict,
                         params: list[torch.nn.Parameter]) -> None:
    """Load a full optimizer state; under FSDP each rank keeps only its shard of every moment.
    `params` is the optimizer's parameter list, in the order its state is indexed."""
    from torch.distributed.tensor import distribute_tensor
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                          src_data_rank=None)
                        if _is_dtensor(p) and torch.is_tensor(v) and v.shape == p.shape else v)
                    for k, v in s.items()}
    optimizer.load_state_dict({**sd, "state": state})


def to_float(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (e.g. clip_grad_norm_'s total norm under FSDP)."""
    return float(t.full_tensor() if _is_dtensor(t) else t)
