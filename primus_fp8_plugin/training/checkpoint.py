"""Checkpoints of a training run: Megatron distributed checkpoints with a checksum manifest, verified
before a resume loads them.

Layout of ``checkpoint.dir``::

    latest.txt                 the directory name of the newest complete checkpoint (written last)
    iter_0000100/              Megatron's distributed checkpoint of step 100 (*.distcp, .metadata, ...)
        manifest.json          the size and SHA-256 of every other file in the directory, the step and
                               the run's configuration; written once every rank has saved

A save hashes the files spread over the ranks, rank 0 writes the manifest and then ``latest.txt`` (each
through a rename, so that neither is ever half-written). A resume reads ``latest.txt``, checks that
every file of the manifest is there with its size and hash (the work again spread over the ranks) and
that the checkpoint's model has this run's shape, then loads. A checkpoint that is corrupted,
incomplete or of another model stops the run with a ``CheckpointError`` naming the file, on every rank.

On resume the schedule of this run's configuration applies from the checkpoint's step on:
``train.steps``, ``lr``, ``min_lr``, ``warmup_steps``, ``lr_decay_style`` and ``weight_decay`` may
change, and the learning rate of each later step is then the one an uninterrupted run with the new
values would have had at that step (Megatron's ``override_opt_param_scheduler``). What changed is
returned (and logged by the loop).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.schema import ConfigError

MANIFEST = "manifest.json"
LATEST = "latest.txt"
MANIFEST_FORMAT = "primus-fp8-plugin checkpoint manifest v1"

# Model settings that change the shapes or the set of the saved tensors: a checkpoint must match them.
# (seq_length only with learned position embeddings; TP/PP sizes may change: the checkpoint reshards.)
MODEL_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "normalization",
    "swiglu", "position_embedding_type", "add_bias_linear", "num_experts",
)  # fmt: skip

# OptimizerParamScheduler.state_dict() keys and the train.* fields they come from
SCHEDULE_FIELDS = {
    "lr_decay_steps": "train.steps",
    "max_lr": "train.lr",
    "min_lr": "train.min_lr",
    "lr_warmup_steps": "train.warmup_steps",
    "lr_decay_style": "train.lr_decay_style",
    "start_wd": "train.weight_decay",
}


# The distributed optimizer's state in Megatron's "dp_reshardable" format: a run may resume with another
# data-parallel size, not another TP/PP split (that load fails with a CheckpointError). Its default
# format (flattened ranges) cannot be saved by Megatron-core 0.19; "fully_reshardable" cannot be loaded
# into torch's Adam (its tensor "step" state), which the CPU runs use.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


@dataclass
class Resumed:
    """Where a run starts: step and consumed samples (0, 0 for a fresh start); for a resume, the
    checkpoint's directory and the schedule fields that changed since it was saved (old, new)."""

    iteration: int = 0
    consumed_samples: int = 0
    path: Path | None = None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _digest(path: Path) -> dict:
    h, n = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of the files ``names`` in ``directory``; a file that cannot be read
    gets ``{"error": reason}``. Collective when a process group is up: each rank hashes every
    world-size-th file and every rank returns the whole map."""
    rank, world = _rank_world()
    mine = {}
    for name in sorted(names)[rank::world]:
        try:
            mine[name] = _digest(directory / name)
        except OSError as err:
            mine[name] = {"error": err.strerror or str(err)}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _config_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    import dataclasses

    return dataclasses.asdict(cfg)


def write_manifest(path: Path, cfg, iteration: int, consumed: int) -> None:
    """Hash every file of the saved checkpoint ``path`` (collective) and write ``path/manifest.json``
    (rank 0, through a rename)."""
    rank, world = _rank_world()
    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST) if rank == 0 else None
    if world > 1:
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    files = hash_files(path, names)
    unreadable = {k: v["error"] for k, v in files.items() if "error" in v}
    if unreadable:
        raise CheckpointError(f"checkpoint.dir: cannot read back the saved {path}: {unreadable}")
    if rank == 0:
        manifest = {
            "format": MANIFEST_FORMAT,
            "iteration": iteration,
            "consumed_samples": consumed,
            "world_size": world,
            "torch": torch.__version__,
            "files": files,
            "config": _config_dict(cfg),
        }
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path / MANIFEST)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)


def read_manifest(path: Path) -> dict:
    """``path/manifest.json``, checked for its format; CheckpointError naming the file otherwise."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint.dir: {file} not found: the save of {path.name} did not finish, or it was written "
            f"without a manifest; write the name of an earlier complete checkpoint into {path.parent / LATEST}, "
            "or set checkpoint.verify=false to load it unchecked"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint.dir: {file} is unreadable ({err})") from None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == MANIFEST_FORMAT
        and isinstance(manifest.get("files"), dict)
        and isinstance(manifest.get("iteration"), int)
        and isinstance(manifest.get("config"), dict)
        and all(isinstance(v, dict) and {"bytes", "sha256"} <= v.keys() for v in manifest["files"].values())
    )
    if not ok:
        raise CheckpointError(f"checkpoint.dir: {file} is not a manifest of this trainer ({MANIFEST_FORMAT})")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Every file the manifest lists is in ``path`` with its size and SHA-256 (collective)."""
    listed = manifest["files"]
    for name, want in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint.dir: {file} is missing (listed in {path / MANIFEST}): the checkpoint is incomplete"
            )
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint.dir: {file} has {size} bytes, {MANIFEST} says {want['bytes']}: the file is truncated or was replaced"
            )
    got = hash_files(path, list(listed))
    for name in sorted(listed):
        if "error" in got[name]:
            raise CheckpointError(f"checkpoint.dir: cannot read {path / name} ({got[name]['error']})")
        if got[name]["sha256"] != listed[name]["sha256"]:
            raise CheckpointError(
                f"checkpoint.dir: {path / name} is corrupted: its SHA-256 differs from the one in {path / MANIFEST}; "
                f"resume from an earlier checkpoint (its name in {path.parent / LATEST}) or set checkpoint.resume=false"
            )


def check_same_model(path: Path, manifest: dict, cfg) -> None:
    """The checkpoint's model (from its manifest's configuration) has this run's shape."""
    saved = manifest["config"].get("model", {})
    fields = list(MODEL_SHAPE_FIELDS)
    if cfg.model.position_embedding_type == "learned_absolute":
        fields.append("seq_length")  # the position embedding table is [seq_length, hidden]
    diff = [
        f"model.{k}={saved.get(k)!r} there, {getattr(cfg.model, k)!r} here"
        for k in fields
        if saved.get(k) != getattr(cfg.model, k)
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint.dir: {path} holds a different model ({'; '.join(diff)}; from {path / MANIFEST}); "
            "point checkpoint.dir at this model's checkpoints, or set checkpoint.resume=false to start over"
        )


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


def _give_fresh_distributed_optimizer_state(optimizer) -> None:
    """Megatron's distributed optimizer reads the step count from its inner optimizer's state while it
    builds the state dict to load into, and a fresh one has none (without Apex or TE, as on a CPU, that
    is an AssertionError): give it placeholder state (Megatron's zero-gradient step), which the load
    then overwrites."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and len(opt.optimizer.state) == 0:
            init()


def _checkpoint_state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool = False) -> dict:
    inner = model.module  # DDP's own (sharded_)state_dict would prefix every key with "module."
    kw = {"is_loading": True} if loading else {}
    if loading:
        _give_fresh_distributed_optimizer_state(optimizer)
    return {
        "model": inner.sharded_state_dict(),
        "optimizer": optimizer.sharded_state_dict(inner.sharded_state_dict(), metadata=OPTIMIZER_METADATA, **kw),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": _rng_state(),
    }


def save_checkpoint(cfg, model, optimizer, scheduler, iteration: int, consumed: int) -> Path:
    """Save step ``iteration`` to ``<checkpoint.dir>/iter_<iteration:07d>`` with its manifest, then
    point ``latest.txt`` at it (collective). A directory of that name left by an earlier run is
    replaced."""
    from megatron.core import dist_checkpointing

    root = Path(cfg.checkpoint.dir)
    path = root / f"iter_{iteration:07d}"
    rank, _ = _rank_world()
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(_checkpoint_state(model, optimizer, scheduler, iteration, consumed), str(path))
    _barrier()
    write_manifest(path, cfg, iteration, consumed)
    if rank == 0:
        _write_latest(root, path.name)
    _barrier()
    return path


def latest_checkpoint(cfg) -> Path | None:
    """The directory ``<checkpoint.dir>/latest.txt`` names, or None when there is nothing to resume."""
    if not (cfg.checkpoint.dir and cfg.checkpoint.resume):
        return None
    latest = Path(cfg.checkpoint.dir) / LATEST
    if not latest.exists():
        return None
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint.dir: cannot read {latest} ({err})") from None
    path = latest.parent / name
    if not name or "/" in name or not path.is_dir():
        raise CheckpointError(
            f"checkpoint.dir: {latest} names {name!r}, which is not a checkpoint directory in {latest.parent}; "
            "write the name of an existing iter_* directory into it, or set checkpoint.resume=false"
        )
    return path


def resume_point(cfg) -> Path | None:
    """The checkpoint a run resumes from, verified (``checkpoint.verify``: manifest, model shape, step,
    every file's size and hash), or None when there is nothing to resume. Collective; cheap enough to
    run first, so that a bad checkpoint stops the run before any data is built or model allocated."""
    path = latest_checkpoint(cfg)
    if path is not None and cfg.checkpoint.verify:
        manifest = read_manifest(path)
        check_same_model(path, manifest, cfg)
        _check_steps(cfg, path, manifest["iteration"])
        verify_files(path, manifest)
    return path


def load_checkpoint(cfg, model, optimizer, scheduler, path: Path | None) -> Resumed:
    """Load the checkpoint at ``path`` (from ``resume_point``; None: a fresh start) into model, optimizer,
    scheduler and the RNGs (collective), and apply this run's schedule from its step on.

    ``scheduler`` must be built from this run's configuration with ``override_opt_param_scheduler=True``."""
    from megatron.core import dist_checkpointing

    if path is None:
        return Resumed()
    try:
        state = dist_checkpointing.load(_checkpoint_state(model, optimizer, scheduler, 0, 0, loading=True), str(path))
        _check_steps(cfg, path, int(state["iteration"]))
        saved_schedule, schedule = state["scheduler"], scheduler.state_dict()
        model.module.load_state_dict(state["model"])
        _load_optimizer(optimizer, state["optimizer"], saved_schedule, schedule)
        scheduler.load_state_dict(saved_schedule)  # keeps this run's schedule (override), takes the step count
        _set_rng_state(state["rng"])
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever Megatron/torch raise for a checkpoint they cannot load
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"checkpoint.dir: cannot load {path}: {type(err).__name__}: {first[:500]}") from err
    changed = {f: (saved_schedule.get(k), schedule[k]) for k, f in SCHEDULE_FIELDS.items()}
    changed = {f: (old, new) for f, (old, new) in changed.items() if old != new}
    return Resumed(int(state["iteration"]), int(state["consumed_samples"]), path, changed)


def _check_steps(cfg, path: Path, iteration: int) -> None:
    if iteration > cfg.train.steps:
        raise ConfigError(
            f"train.steps: {cfg.train.steps}, but the checkpoint {path} is at step {iteration}; "
            "raise train.steps to continue it, or set checkpoint.resume=false to start over"
        )


def _load_optimizer(optimizer, state: dict, saved_schedule: dict, schedule: dict) -> None:
    """Load the optimizer state, keeping this run's per-group ``max_lr``/``min_lr``. Megatron matches saved
    parameter groups to the current ones by these values, so for the load the current groups take the
    values they were saved with, and get this run's back afterwards."""
    groups = optimizer.param_groups
    mine = [(g.get("max_lr"), g.get("min_lr")) for g in groups]
    for g in groups:
        if g.get("max_lr") == schedule["max_lr"]:
            g["max_lr"] = saved_schedule.get("max_lr", g["max_lr"])
        if g.get("min_lr") == schedule["min_lr"]:
            g["min_lr"] = saved_schedule.get("min_lr", g["min_lr"])
    try:
        optimizer.load_state_dict(state)
    finally:
        for g, (max_lr, min_lr) in zip(optimizer.param_groups, mine, strict=True):
            g["max_lr"], g["min_lr"] = max_lr, min_lr
    _restore_torch_adam_steps(optimizer)


def _restore_torch_adam_steps(optimizer) -> None:
    """Without Apex or TE (CPU runs) Megatron's distributed optimizer saves torch Adam's step count in
    each parameter group, and its load leaves every parameter's ``step`` at the placeholder's value
    (see ``_give_fresh_distributed_optimizer_state``): set it to the group's saved count."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" not in group:
                continue
            for p in group["params"]:
                st = inner.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor):
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype, device=st["step"].device)
