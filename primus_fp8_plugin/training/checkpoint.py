"""Checkpoints of a training run: Megatron distributed checkpoints of the model, optimizer, scheduler,
RNG states, step and consumed samples, in ``<checkpoint.dir>/iter_<step:07d>``, with
``<checkpoint.dir>/latest.txt`` naming the newest."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _checkpoint_state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool = False) -> dict:
    inner = model.module  # DDP's own (sharded_)state_dict would prefix every key with "module."
    kw = {"is_loading": True} if loading else {}
    return {
        "model": inner.sharded_state_dict(),
        "optimizer": optimizer.sharded_state_dict(inner.sharded_state_dict(), **kw),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": _rng_state(),
    }


def save_checkpoint(cfg, model, optimizer, scheduler, iteration: int, consumed: int) -> Path:
    from megatron.core import dist_checkpointing

    path = Path(cfg.checkpoint.dir) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_checkpoint_state(model, optimizer, scheduler, iteration, consumed), str(path))
    if dist.get_rank() == 0:
        (Path(cfg.checkpoint.dir) / "latest.txt").write_text(path.name)
    dist.barrier()
    return path


def load_checkpoint(cfg, model, optimizer, scheduler) -> tuple[int, int]:
    """(iteration, consumed samples) of the latest checkpoint, loaded into the objects; (0, 0) if none."""
    from megatron.core import dist_checkpointing

    latest = Path(cfg.checkpoint.dir or "") / "latest.txt"
    if not (cfg.checkpoint.dir and cfg.checkpoint.resume and latest.exists()):
        return 0, 0
    path = latest.parent / latest.read_text().strip()
    state = dist_checkpointing.load(_checkpoint_state(model, optimizer, scheduler, 0, 0, loading=True), str(path))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return int(state["iteration"]), int(state["consumed_samples"])
