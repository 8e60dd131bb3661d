"""What every rank of a run must agree on: rank and world size with or without a process group, a
barrier, and decisions that rank 0 alone takes (locks, files it owns) with their errors raised on
every rank, so that a refusal stops all ranks with the same message instead of hanging the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..config.schema import ConfigError

T = TypeVar("T")


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank0_decides(decide: Callable[[], T]) -> T:
    """``decide()`` run on rank 0 and its result given to every rank (picklable). A ConfigError (or
    subclass) it raises is raised on every rank, as the same class with the same message; any other
    exception on rank 0 is raised there and as a RuntimeError naming it on the others."""
    rank, world = rank_world()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", decide())
        except ConfigError as err:
            box[0] = ("error", type(err), str(err))
        except Exception as err:  # any other failure: rank 0 raises it, the others a RuntimeError naming it
            if world > 1:
                dist.broadcast_object_list([("error", RuntimeError, f"rank 0 failed: {type(err).__name__}: {err}")], src=0)
            raise
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        _, cls, message = box[0]
        raise cls(message)
    return box[0][1]
