"""A run's records: ``metrics.jsonl`` (one JSON object a line, one run per file), the console (lines,
or a progress bar with lines above it), and optionally TensorBoard (Megatron's ``--tensorboard-dir``:
``torch.utils.tensorboard.SummaryWriter`` with Megatron's scalar names) and Weights & Biases.

One run per file: a run starting fresh refuses a ``metrics.jsonl`` that already holds records. A run
resuming its own checkpoint (the file's ``start`` event has the checkpoint's ``run_id``) continues
the file: the records after the checkpoint's step (which the resumed run computes again) are removed
first, so every step appears once, in order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config.schema import ConfigError

METRICS_FILE = "metrics.jsonl"
GiB = 2**30
# metrics.jsonl keys -> Megatron's TensorBoard scalar names (megatron/training/training.py)
TENSORBOARD_NAMES = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "mfu": "mfu",
    "memory_bytes": "mem-max-allocated-bytes",
    "valid_loss": "lm loss validation",
}


def _record_step(record: dict) -> int | None:
    step = record.get("step", record.get("start_step"))
    return step if isinstance(step, int) else None


def read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics file and how many unreadable lines ended it (a write cut short by a
    kill). ConfigError naming the line when one before the last is unreadable."""
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return records, 1
            raise ConfigError(f"logging.dir: line {i + 1} of {path} is not JSON: the file is damaged") from None
        records.append(record)
    return records, 0


def claim_metrics_file(path: Path, run_id: str, resume_step: int | None) -> int:
    """Make ``path`` this run's metrics file: absent or empty, or (``resume_step`` given) the file of
    run ``run_id``, cut back to its records up to ``resume_step``. Returns how many records were cut.
    ConfigError when the file holds another run's records (or this run starts fresh over them)."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    records, torn = read_records(path)
    start = next((r for r in records if r.get("event") == "start"), {})
    owner = start.get("run_id")
    if resume_step is None or owner != run_id:
        what = f"run {owner}" if owner else "a run"
        why = "this run starts fresh" if resume_step is None else f"this run resumes run {run_id}"
        raise ConfigError(
            f"logging.dir: {path} already holds the metrics of {what} ({len(records)} records), and {why}: "
            "one metrics file holds one run. Choose another logging.dir (each run gets a new output directory "
            "by default), or remove the file; to continue that run, resume its checkpoint with the same logging.dir"
        )
    keep = [r for r in records if (_record_step(r) or 0) <= resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    return len(records) - len(keep) + torn


def human_bytes(n: int) -> str:
    """``1.2 GiB``, ``14.6 MiB``, ``512 B``."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def console_line(record: dict) -> str:
    """A record as the console shows it: ``key=value``, floats to 4 digits, memory in GiB, MFU in percent
    (``n/a`` where the device's peak is unknown)."""
    if record.get("event") == "checkpoint":
        return (f"saved checkpoint {Path(record['path']).name} ({human_bytes(record['bytes'])}) in {record['seconds']:.1f} s"
                + (f"; removed {', '.join(record['pruned'])}" if record.get("pruned") else ""))  # fmt: skip
    parts = []
    for k, v in record.items():
        if k == "memory_bytes":
            parts.append(f"mem={v / GiB:.2f}GiB")
        elif k == "mfu":
            parts.append("mfu=n/a" if v is None else f"mfu={100 * v:.1f}%")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


class TensorBoardSink:
    """Scalars into TensorBoard event files, as Megatron's ``--tensorboard-dir`` writes them."""

    def __init__(self, directory: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                f"logging.tensorboard_dir: TensorBoard logging needs the tensorboard package ({err}); "
                "pip install tensorboard (or primus-fp8-plugin[tensorboard]), or leave logging.tensorboard_dir unset"
            ) from None
        self.writer = SummaryWriter(log_dir=directory, max_queue=1000)

    def write(self, record: dict) -> None:
        step = record.get("step")
        if "event" in record or not isinstance(step, int):
            return
        for key, name in TENSORBOARD_NAMES.items():
            if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool):
                self.writer.add_scalar(name, record[key], step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """The same scalars into a Weights & Biases run whose id is the run's ``run_id`` (a resumed run
    continues its W&B run)."""

    def __init__(self, project: str, run_id: str, run_dir: str, config: dict):
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(
                f"logging.wandb_project: W&B logging needs the wandb package ({err}); pip install wandb "
                "(or primus-fp8-plugin[wandb]), or leave logging.wandb_project unset"
            ) from None
        self.wandb = wandb
        self.run = wandb.init(project=project, id=run_id, name=Path(run_dir).name, dir=run_dir, config=config,
                              resume="allow")  # fmt: skip

    def write(self, record: dict) -> None:
        step = record.get("step")
        values = {TENSORBOARD_NAMES[k]: v for k, v in record.items() if k in TENSORBOARD_NAMES and isinstance(v, (int, float))}
        if "event" not in record and isinstance(step, int) and values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg, run_id: str, config: dict) -> list:
    """The TensorBoard and W&B sinks ``cfg.logging`` asks for (ConfigError when a package is missing)."""
    sinks = []
    if cfg.logging.tensorboard_dir:
        sinks.append(TensorBoardSink(str(cfg.logging.tensorboard_dir)))
    if cfg.logging.wandb_project:
        sinks.append(WandbSink(str(cfg.logging.wandb_project), run_id, str(cfg.logging.dir), config))
    return sinks


class Metrics:
    """The run's records on rank 0: ``metrics.jsonl`` (claimed with ``claim_metrics_file`` first), the
    console and the sinks of ``open_sinks``. Other ranks record nothing."""

    def __init__(self, cfg, rank: int, start: int, sinks: list | None = None):
        self.rank = rank
        self.path = Path(cfg.logging.dir) / METRICS_FILE
        self.sinks = sinks or []
        self.bar = None
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cfg.logging.progress:
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.train.steps, initial=start, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)
        line = console_line(record)
        if self.bar is None:
            print(line, flush=True)
        elif "event" not in record and {"loss", "lr", "tokens_per_s"} <= record.keys():  # a training step
            post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            if "memory_bytes" in record:
                post["mem"] = f"{record['memory_bytes'] / GiB:.2f}GiB"
            if record.get("mfu") is not None:
                post["mfu"] = f"{100 * record['mfu']:.1f}%"
            self.bar.set_postfix(post)
        else:  # validation losses and events: a line above the bar
            self.bar.write(line)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None  # later records (the end event) print as lines
        for sink in self.sinks:
            sink.close()
        self.sinks = []
