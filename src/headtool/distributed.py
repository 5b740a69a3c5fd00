"""Data parallelism on an existing engine: torchrun / accelerate launch set the environment.

Scoring: each rank scores its share of the batches (every world_size-th batch); the accumulated
sums and their weights are all-reduced, so every rank ends with the single-process result on the
same batches (up to summation order). Healing: DDP over a `World`. Rank 0 alone writes and prints.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def launched() -> bool:
    """True under torchrun / accelerate launch with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(device: torch.device | str | None) -> str:
    """The process-group backend for the device a run computes on: nccl on CUDA, else gloo.

    `device` is what the run uses ('cpu', 'cuda:1', a torch.device); 'auto' or None mean what
    `--device auto` picks, CUDA when it is available.
    """
    if device is None or str(device) == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):  # not a device name: the loader reports it
        kind = str(device)
    return "nccl" if kind == "cuda" else "gloo"


def init_from_env(device: torch.device | None = None) -> None:
    """Join the process group that the launcher describes (gloo on CPU, nccl on CUDA)."""
    import torch.distributed as dist

    if not launched() or dist.is_initialized():
        return
    dist.init_process_group(backend=backend_for(device if device is not None else "cpu"))
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_and_world()[0] == 0


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share: every world_size-th item, starting at its rank."""
    rank, world = rank_and_world()
    return list(items)[rank::world]


def combine_means(means: list[list[float]], mean_loss: float, weight: float) -> tuple[list[list[float]], float, float]:
    """Global weighted means from per-rank means: sum(mean_r * w_r) / sum(w_r), in float64."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        return means, mean_loss, weight
    flat = [v for row in means for v in row]
    t = torch.tensor([*(v * weight for v in flat), mean_loss * weight, weight], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    total_w = float(t[-1])
    scale = 1.0 / max(total_w, 1.0)
    out, i = [], 0
    for row in means:
        out.append([float(x) * scale for x in t[i:i + len(row)]])
        i += len(row)
    return out, float(t[-2]) * scale, total_w


def finish() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclass(frozen=True)
class World:
    """This process's place in a data-parallel run (rank 0 of 1 without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def world_from_env(device: torch.device | str | None = "auto") -> World:
    """Join the process group that torchrun / accelerate launch set up, with the backend of the
    device the run uses (`backend_for`: gloo for --device cpu even where CUDA exists)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def finish_world(world: World) -> None:
    """Leave the process group at the end of a torchrun job."""
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()
