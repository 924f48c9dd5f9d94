"""Multi-process data parallel training: `torchrun --nproc_per_node N -m draftsmith train ...`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; a plain
`draftsmith train` (no torchrun) is world size 1 and never touches torch.distributed.
Backend: gloo on CPU, nccl on CUDA. Only rank 0 logs, shows a progress bar and writes
checkpoints; every rank computes the same schedule and takes the same number of steps.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun set up (a no-op for a single process)."""
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise DraftsmithError(f"train.device={device!r} but CUDA is not available; use train.device=cpu")
    if want_cuda:
        if world > 1:  # one GPU per process
            dev = torch.device("cuda", local_rank)
        else:
            dev = torch.device("cuda", 0) if device in ("auto", "cuda") else torch.device(device)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


class LossModule(nn.Module):
    """Puts `training_loss` behind `forward`, which is where DDP hooks its gradient sync.

    Returns (total, parts) rather than the LossOutput dataclass so DDP sees a plain tuple.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any, generator: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
        out = self.model.training_loss(batch, generator)
        return out.total, dict(out.parts)


def wrap(model: nn.Module, info: DistInfo, find_unused: bool = False) -> nn.Module:
    """LossModule, inside DistributedDataParallel when there are several processes."""
    lm = LossModule(model)
    if not info.enabled:
        return lm

    kw: dict[str, Any] = {"find_unused_parameters": find_unused}
    if info.device.type == "cuda":
        kw["device_ids"] = [info.device.index]
    return DDP(lm, **kw)


def mean_over_ranks(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average logged scalars over processes (same keys on every rank)."""
    if not info.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                     device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    t /= info.world_size
    return dict(zip(keys, t.tolist()))


def sum_over_ranks(x: float, info: DistInfo) -> float:
    if not info.enabled:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return float(t.item())


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's `obj`, in rank order (for per-rank RNG states in a checkpoint)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
