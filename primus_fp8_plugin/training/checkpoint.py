"""Checkpoints of a training run: Megatron distributed checkpoints with a checksum manifest, saved
crash-safely (``checkpoint_store.py``), verified and compared with this run before a resume loads them.

Each checkpoint directory ``iter_<step>`` holds Megatron's distributed checkpoint (``*.distcp``,
``.metadata``, ...) and ``manifest.json``: the size and SHA-256 of every other file, the step, the
saving run's configuration and its ``run`` record (``run_id``, the backend ``auto`` resolved to, the
world size, the plugin's version). A save writes into a staging directory, hashes and fsyncs every
file (spread over the ranks), checks that the manifest's files are all there with their sizes, and
only then renames it into place and moves ``latest.txt``.

Where a run starts (``start_point``): from the newest checkpoint of its own ``checkpoint.dir``
(``latest.txt``), else from ``checkpoint.load`` (another run's checkpoint directory or one of its
``iter_*`` directories, as Megatron's ``--load``), else fresh. Before anything is built the
checkpoint's files are checked against its manifest, its model must have this run's shapes, and the
saving run's identity (``RUN_IDENTITY`` in ``config/schema.py``: model, fp8, the resolved backend,
data, seed, parallel layout) must be this run's, except for the fields ``checkpoint.allow_changes``
names; each difference is named (old -> new) and the run stops with exit status 2. Resuming its own
checkpoint a run keeps its ``run_id``; starting from another run's (``checkpoint.load``) it gets a
new one.

On resume the schedule of this run's configuration applies from the checkpoint's step on:
``train.steps``, ``lr``, ``min_lr``, ``warmup_steps``, ``lr_decay_style`` and ``weight_decay`` may
change, and the learning rate of each later step is then the one an uninterrupted run with the new
values would have had at that step (Megatron's ``override_opt_param_scheduler``). Every field that
changed (identity fields allowed to, schedule and others; not where the run logs or saves) is
returned and logged in the ``resume`` event.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.schema import NOT_IDENTITY, RUN_IDENTITY, ConfigError
from . import checkpoint_store as store
from .collective import barrier, rank0_decides, rank_world

MANIFEST = "manifest.json"
LATEST = store.LATEST
MANIFEST_FORMAT = "primus-fp8-plugin checkpoint manifest v1"

# Model settings that change the shapes or the set of the saved tensors: a checkpoint must match them,
# whatever checkpoint.allow_changes says (seq_length only with learned position embeddings).
MODEL_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "normalization",
    "swiglu", "position_embedding_type", "add_bias_linear", "num_experts",
)  # fmt: skip
# where a run logs and saves, not what it computes: never compared
NOT_COMPARED = ("checkpoint", "logging", "data.cache_dir")


# The distributed optimizer's state in Megatron's "dp_reshardable" format: a run may resume with another
# data-parallel size, not another TP/PP split (that load fails with a CheckpointError). Its default
# format (flattened ranges) cannot be saved by Megatron-core 0.19; "fully_reshardable" cannot be loaded
# into torch's Adam (its tensor "step" state), which the CPU runs use.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved or resumed from; the message names the file and what to do."""


@dataclass
class RunInfo:
    """What a run records in each manifest beside its configuration. ``backend``: the backend the
    plugin's linears use (``auto`` resolved), None when the fp8 mode runs none of them."""

    run_id: str
    backend: str | None
    world_size: int

    def record(self) -> dict:
        from .. import __version__

        return {"run_id": self.run_id, "backend": self.backend, "world_size": self.world_size, "version": __version__}


@dataclass
class StartPoint:
    """Where a run starts: the checkpoint to load (None: fresh weights), the setting it came from
    (``checkpoint.dir`` or ``checkpoint.load``), this run's ``run_id``, the checkpoint's step (None
    when unknown: no checkpoint, or one without a manifest), what changed since it was saved (field ->
    (old, new)) and what ``checkpoint_store.recover`` repaired."""

    path: Path | None
    source: str
    run_id: str
    iteration: int | None = None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    repaired: list[str] = field(default_factory=list)


@dataclass
class Resumed:
    """Where training starts: step and consumed samples (0, 0 for a fresh start); for a resume, the
    checkpoint's directory and what changed since it was saved (field -> (old, new))."""

    iteration: int = 0
    consumed_samples: int = 0
    path: Path | None = None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)


@dataclass
class Saved:
    """A finished save: the checkpoint's directory, its bytes (the manifest's files), the wall time, and
    the older checkpoints ``checkpoint.keep_latest`` removed after it."""

    path: Path
    bytes: int
    seconds: float
    pruned: list[str]


def _digest(path: Path) -> dict:
    h, n = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            n += len(chunk)
        store.fsync_fd(f.fileno())  # what was hashed is on the storage, not only in the page cache
    return {"bytes": n, "sha256": h.hexdigest()}


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of the files ``names`` in ``directory``, each fsynced; a file that
    cannot be read gets ``{"error": reason}``. Collective when a process group is up: each rank hashes
    every world-size-th file and every rank returns the whole map."""
    rank, world = rank_world()
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


def config_dict(cfg) -> dict:
    """The configuration as plain, resolved data."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    import dataclasses

    return dataclasses.asdict(cfg)


def write_manifest(path: Path, cfg, iteration: int, consumed: int, run: RunInfo) -> None:
    """Hash and fsync every file of the saved checkpoint ``path`` (collective) and write
    ``path/manifest.json`` (rank 0, written aside, fsynced and renamed)."""
    rank, world = rank_world()
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
            "config": config_dict(cfg),
            "run": run.record(),
        }
        store.write_atomic(path / MANIFEST, json.dumps(manifest, indent=1))


def read_manifest(path: Path, source: str = "checkpoint.dir") -> dict:
    """``path/manifest.json``, checked for its format; CheckpointError naming the file otherwise."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{source}: {file} not found: the save of {path.name} did not finish, or it was written "
            f"without a manifest; write the name of an earlier complete checkpoint into {path.parent / LATEST}, "
            "or set checkpoint.verify=false to load it unchecked"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{source}: {file} is unreadable ({err})") from None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == MANIFEST_FORMAT
        and isinstance(manifest.get("files"), dict)
        and isinstance(manifest.get("iteration"), int)
        and isinstance(manifest.get("config"), dict)
        and all(isinstance(v, dict) and {"bytes", "sha256"} <= v.keys() for v in manifest["files"].values())
    )
    if not ok:
        raise CheckpointError(f"{source}: {file} is not a manifest of this trainer ({MANIFEST_FORMAT})")
    return manifest


def check_sizes(path: Path, manifest: dict, source: str = "checkpoint.dir") -> None:
    """Every file the manifest lists is in ``path`` with its size."""
    for name, want in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{source}: {file} is missing (listed in {path / MANIFEST}): the checkpoint is incomplete"
            )
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{source}: {file} has {size} bytes, {MANIFEST} says {want['bytes']}: the file is truncated or was replaced"
            )


def verify_files(path: Path, manifest: dict, source: str = "checkpoint.dir") -> None:
    """Every file the manifest lists is in ``path`` with its size and SHA-256 (collective)."""
    check_sizes(path, manifest, source)
    listed = manifest["files"]
    got = hash_files(path, list(listed))
    for name in sorted(listed):
        if "error" in got[name]:
            raise CheckpointError(f"{source}: cannot read {path / name} ({got[name]['error']})")
        if got[name]["sha256"] != listed[name]["sha256"]:
            raise CheckpointError(
                f"{source}: {path / name} is corrupted: its SHA-256 differs from the one in {path / MANIFEST}; "
                f"resume from an earlier checkpoint (its name in {path.parent / LATEST}) or use another checkpoint.dir"
            )


def check_same_model(path: Path, manifest: dict, cfg, source: str = "checkpoint.dir") -> None:
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
            f"{source}: {path} holds a different model ({'; '.join(diff)}; from {path / MANIFEST}); "
            "its weights cannot be loaded into this model: use another checkpoint.dir for this model"
        )


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def run_fields(config: dict, run: dict) -> dict[str, Any]:
    """A run's compared fields: its configuration's leaves (``train.lr``) but where it logs and saves,
    plus ``backend.resolved`` and ``parallel.world_size`` from its ``run`` record."""
    fields = {k: v for k, v in _flatten(config).items() if not _under(k, NOT_COMPARED)}
    fields["backend.resolved"] = run.get("backend")
    fields["parallel.world_size"] = run.get("world_size")
    return fields


def compare_runs(saved: dict[str, Any], mine: dict[str, Any], allowed) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(every changed field, the identity fields among them that ``allowed`` does not name), each
    ``{field: (old, new)}``. A field one side does not record (an older manifest's run record, a
    backend where one side runs no plugin linears) is not compared."""
    changed, refused = {}, {}
    for key in sorted(set(saved) | set(mine)):
        old, new = saved.get(key), mine.get(key)
        if old == new or (key in ("backend.resolved", "parallel.world_size") and (old is None or new is None)):
            continue
        changed[key] = (old, new)
        if _under(key, RUN_IDENTITY) and not _under(key, NOT_IDENTITY) and not _under(key, list(allowed)):
            refused[key] = (old, new)
    return changed, refused


def check_identity(path: Path, manifest: dict, cfg, run: RunInfo, source: str) -> dict[str, tuple]:
    """Compare the run that saved ``path`` with this one; CheckpointError naming every identity field
    that differs and ``checkpoint.allow_changes`` does not name. Returns every changed field."""
    mine = run_fields(config_dict(cfg), run.record())
    saved = run_fields(manifest["config"], manifest.get("run") or {})
    changed, refused = compare_runs(saved, mine, cfg.checkpoint.allow_changes)
    if refused:
        diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise CheckpointError(
            f"{source}: {path} was saved by a run with other settings ({diff}); resuming it would continue that "
            "run's weights as this run's. Use another checkpoint.dir (checkpoint=periodic: each run saves into its "
            "own output directory), or allow these changes: "
            f"checkpoint.allow_changes=[{','.join(refused)}]"
        )
    return changed


def latest_checkpoint(root: Path, source: str = "checkpoint.dir") -> Path | None:
    """The directory ``root/latest.txt`` names, or None when there is no ``latest.txt``."""
    latest = Path(root) / LATEST
    if not latest.exists():
        return None
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{source}: cannot read {latest} ({err})") from None
    path = latest.parent / name
    if not name or "/" in name or not path.is_dir():
        raise CheckpointError(
            f"{source}: {latest} names {name!r}, which is not a checkpoint directory in {latest.parent}; "
            "write the name of an existing iter_* directory into it, or use another checkpoint.dir"
        )
    return path


def _checkpoint_at(location: str) -> Path:
    """``checkpoint.load``'s checkpoint: ``location`` itself (an ``iter_*`` directory) or the one its
    ``latest.txt`` names."""
    root = Path(location)
    if (root / MANIFEST).is_file() or (root / ".metadata").is_file():
        return root
    path = latest_checkpoint(root, "checkpoint.load") if root.is_dir() else None
    if path is None:
        raise CheckpointError(
            f"checkpoint.load: {root} is not a checkpoint (no {MANIFEST}) nor a checkpoint directory (no {LATEST}); "
            "give another run's checkpoint.dir or one of its iter_* directories"
        )
    return path


def _locate(cfg) -> tuple[Path | None, str, list[str]]:
    """(the checkpoint to start from or None, the setting it came from, what ``recover`` repaired);
    rank 0 (it owns checkpoint.dir)."""
    repaired, own = [], None
    if cfg.checkpoint.dir:
        root = Path(cfg.checkpoint.dir)
        repaired = store.recover(root)
        own = latest_checkpoint(root)
        if own is not None and not cfg.checkpoint.resume:
            raise CheckpointError(
                f"checkpoint.dir: {root} holds checkpoints (latest: {own.name}) and checkpoint.resume=false starts "
                "fresh weights: its saves would mix with them. Use another checkpoint.dir, or remove those checkpoints"
            )
    if own is not None:
        return own, "checkpoint.dir", repaired
    if cfg.checkpoint.load and cfg.checkpoint.resume:
        return _checkpoint_at(str(cfg.checkpoint.load)), "checkpoint.load", repaired
    return None, "checkpoint.dir", repaired


def start_point(cfg, backend: str | None) -> StartPoint:
    """Where this run starts, checked (collective; run before any data is built or model allocated):
    the checkpoint's manifest, model shape and step, the saving run's identity (``check_identity``)
    and, with ``checkpoint.verify``, every file's size and hash (without it, a checkpoint without a
    manifest loads unchecked). ``backend``: as ``RunInfo.backend``."""
    path, source, repaired, fresh_id = rank0_decides(lambda: (*_locate(cfg), uuid.uuid4().hex[:12]))
    if path is None:
        return StartPoint(None, source, fresh_id, repaired=repaired)
    changed: dict[str, tuple] = {}
    run_id, iteration = fresh_id, None
    if cfg.checkpoint.verify or (path / MANIFEST).is_file():
        manifest = read_manifest(path, source)
        check_same_model(path, manifest, cfg, source)
        saved_id = (manifest.get("run") or {}).get("run_id")
        if source == "checkpoint.dir" and saved_id:
            run_id = saved_id  # resuming its own checkpoint: the same run
        changed = check_identity(path, manifest, cfg, RunInfo(run_id, backend, rank_world()[1]), source)
        iteration = manifest["iteration"]
        _check_steps(cfg, path, iteration)
        if cfg.checkpoint.verify:
            verify_files(path, manifest, source)
    return StartPoint(path, source, run_id, iteration, changed, repaired)


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


def _as_checkpoint_error(err: BaseException, what: str) -> CheckpointError:
    """Any exception of a checkpoint operation (torch's CheckpointException is a BaseException) as a
    CheckpointError saying ``what`` failed, with the last line of the cause (a CheckpointException
    carries each rank's traceback: its last line is the error that stopped the load)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    cause = lines[-1].strip() if lines else type(err).__name__
    if len(cause) > 400:
        cause = cause[:400] + " ..."
    return CheckpointError(f"{what}: {cause}")


def save_checkpoint(cfg, model, optimizer, scheduler, iteration: int, consumed: int, run: RunInfo) -> Saved:
    """Save step ``iteration`` as ``<checkpoint.dir>/iter_<iteration:07d>`` with its manifest, then point
    ``latest.txt`` at it and prune (``checkpoint.keep_latest``); collective. Crash-safe: see
    ``checkpoint_store.py`` (an earlier checkpoint of the same step is replaced only once the new one
    is in place)."""
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    root = Path(cfg.checkpoint.dir)
    rank, _ = rank_world()
    staged = rank0_decides(lambda: store.staging(root, iteration))
    try:
        dist_checkpointing.save(_checkpoint_state(model, optimizer, scheduler, iteration, consumed), str(staged))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - whatever Megatron/torch raise: named, with the directory
        raise _as_checkpoint_error(err, f"checkpoint.dir: cannot save step {iteration} into {staged}") from err
    barrier()
    if rank == 0:
        store.reached("written", iteration)
    write_manifest(staged, cfg, iteration, consumed, run)
    barrier()

    def publish() -> tuple[Path, int, list[str]]:
        manifest = read_manifest(staged)  # complete and verified before it moves into place
        check_sizes(staged, manifest)
        if not (staged / ".metadata").is_file():
            raise CheckpointError(f"checkpoint.dir: {staged} has no .metadata: Megatron's save did not complete")
        store.reached("manifest", iteration)
        final = store.publish(root, staged, iteration)
        pruned = store.prune(root, cfg.checkpoint.keep_latest, final)
        return final, sum(f["bytes"] for f in manifest["files"].values()), pruned

    final, size, pruned = rank0_decides(publish)
    return Saved(final, size, time.perf_counter() - t0, pruned)


def load_checkpoint(cfg, model, optimizer, scheduler, start: StartPoint) -> Resumed:
    """Load the checkpoint ``start`` names (None: a fresh start) into model, optimizer, scheduler and the
    RNGs (collective), and apply this run's schedule from its step on. Whatever fails in the load
    becomes a CheckpointError naming the checkpoint.

    ``scheduler`` must be built from this run's configuration with ``override_opt_param_scheduler=True``."""
    from megatron.core import dist_checkpointing

    path = start.path
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
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is not an Exception
        hint = ""
        if "parallel.use_distributed_optimizer" in start.changed:
            saved_with = start.changed["parallel.use_distributed_optimizer"][0]
            hint = (f" (saved with parallel.use_distributed_optimizer={saved_with}: Megatron cannot load one "
                    "optimizer's state into the other)")  # fmt: skip
        raise _as_checkpoint_error(err, f"{start.source}: cannot load {path}{hint}") from err
    return Resumed(int(state["iteration"]), int(state["consumed_samples"]), path, dict(start.changed))


def _check_steps(cfg, path: Path, iteration: int) -> None:
    if iteration > cfg.train.steps:
        raise ConfigError(
            f"train.steps: {cfg.train.steps}, but the checkpoint {path} is at step {iteration}; "
            "raise train.steps to continue it, or use another checkpoint.dir to start over"
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
