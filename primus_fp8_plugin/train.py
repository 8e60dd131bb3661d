"""Train a GPT with Megatron-core and FP8 blockwise linears: a Hydra application.

    python -m primus_fp8_plugin.train                               # the embedded default (CPU or GPU)
    python -m primus_fp8_plugin.train fp8=bf16 model=gpt_125m parallel.tp=2 train.steps=2000
    python -m primus_fp8_plugin.train --help                        # groups, options, the composed config
    python -m primus_fp8_plugin.train --cfg job                     # print the composed config, do not run
    python -m primus_fp8_plugin.train --version                     # the plugin's version
    python -m primus_fp8_plugin.train -m fp8=bf16,blockwise train.steps=100   # a sweep: one run per value
    torchrun --nproc-per-node 2 -m primus_fp8_plugin.train parallel=tp2_sp

The config tree is ``configs/`` (groups model, fp8, backend, parallel, data, train, checkpoint,
logging; shipped inside the package as ``primus_fp8_plugin/configs``); the schema is
``primus_fp8_plugin/config/schema.py``. A bad value stops the run at start-up with a message naming
the field and exit status 2.

Output directory: each run gets its own, ``outputs/DATE/TIME`` (a sweep: ``multirun/DATE/TIME/N``),
holding ``metrics.jsonl``, Hydra's ``.hydra/`` (composed config, overrides), ``train.log`` (what the
console showed) and, with ``checkpoint=periodic``, ``checkpoints/``. ``logging.dir=DIR`` on the
command line makes ``DIR`` the run's output directory instead (in a sweep: the sweep's directory,
each job in ``DIR/N``). A run locks its directories (``run.lock``): a second live run on them stops
with exit status 2, naming the first. Re-running with the same ``logging.dir`` resumes that run from
its newest checkpoint and continues its ``metrics.jsonl``; without a checkpoint of that run to resume
it stops (exit 2) instead of writing a second run into the directory. Relative paths
(``data.cache_dir``, ``checkpoint.dir``) are relative to the directory the command runs in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from pathlib import Path


def find_config_dir() -> Path:
    """The Hydra config tree: ``configs/`` inside the package (an installed wheel carries it; in a
    checkout it links to the top-level ``configs/``), else the checkout's ``configs/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    return here / "configs"


CONFIG_DIR = find_config_dir()


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    from .config.schema import Config

    ConfigStore.instance().store(name="schema", node=Config)


def compose(*overrides: str):
    """The read-only configuration ``python -m primus_fp8_plugin.train OVERRIDES`` trains, composed in this process
    (tools and tests: no run directory, no Hydra output)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    _register_schema()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _quiet_megatron() -> None:
    # Megatron's notices about absent apex/TE fallbacks and GPTModel's deprecation are not the user's business.
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE).*")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    # torch's notice on every distributed-checkpoint load, about an argument order Megatron already uses
    warnings.filterwarnings("ignore", message="The argument order of load has been changed")


def _is_multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in args)


def _last_override(args: list[str], key: str) -> int | None:
    """The index of the last ``key=...`` (also ``+key=``, ``++key=``) among the overrides."""
    found = None
    for i, a in enumerate(args):
        name, eq, _ = a.lstrip("+").partition("=")
        if eq and name == key:
            found = i
    return found


def _override_value(args: list[str], key: str) -> str | None:
    """The raw value of the last ``key=...`` (also ``+key=``, ``++key=``) among the overrides."""
    i = _last_override(args, key)
    return None if i is None else args[i].partition("=")[2]


def _is_sweep(arg: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(arg).is_sweep_override()


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def _with_overrides(args: list[str], extra: list[str]) -> list[str]:
    """``args`` with ``extra`` overrides placed right after the last of its overrides: Hydra's parser
    takes the overrides as one run of positional arguments, so they may not be split by an option
    (``logging.dir=X --cfg job hydra.run.dir=X`` fails)."""
    last = max((i for i, a in enumerate(args) if _is_override(a)), default=len(args) - 1)
    return [*args[: last + 1], *extra, *args[last + 1 :]]


def hydra_args(args: list[str], rank: int) -> list[str]:
    """The command line given to Hydra: ``args`` plus where this process's Hydra output goes.

    ``logging.dir=DIR`` given: one run, ``DIR`` is also Hydra's run directory (one directory per run;
    when ``DIR/.hydra`` holds an earlier invocation's record, this one's goes to ``DIR/.hydra/DATE-TIME-PID``);
    a sweep (``-m``), ``DIR`` is the sweep's directory and each job's ``logging.dir`` its own ``DIR/N``
    (two jobs never share a metrics file or checkpoints). Ranks other than 0 of a torchrun job write no
    Hydra output (no ``.hydra/``, no log file, no timestamped directory of their own); rank 0's
    directory holds the run's outputs."""
    args = list(args)
    if rank != 0:
        return _with_overrides(args, ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none"])  # fmt: skip
    at = _last_override(args, "logging.dir")
    if at is None:
        return args
    log_dir = args[at].partition("=")[2]
    if not _is_multirun(args):
        if _override_value(args, "hydra.run.dir") is None:
            args = _with_overrides(args, [f"hydra.run.dir={log_dir}"])
        if (Path(log_dir) / ".hydra" / "config.yaml").is_file() and _override_value(args, "hydra.output_subdir") is None:
            # a run directory used before (a resume, or a run about to be refused): its record stays
            args = _with_overrides(args, [f"hydra.output_subdir=.hydra/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"])
        return args
    if _is_sweep(args[at]) or _override_value(args, "hydra.sweep.dir") is not None:
        return args  # a value per job, or the sweep's directory chosen: as given
    # every override of logging.dir gives way to the sweep directory
    kept = [a for a in args if not (_is_override(a) and a.lstrip("+").partition("=")[0] == "logging.dir")]
    return _with_overrides(kept, [f"hydra.sweep.dir={log_dir}"])


def _train(cfg) -> int:
    """One run (Hydra's task function body). Returns the exit status."""
    from omegaconf import OmegaConf

    _quiet_megatron()  # before the first import of megatron (Hydra configured logging at INFO already)
    from .config import ConfigError
    from .training.loop import run

    OmegaConf.set_readonly(cfg, True)
    try:
        summary = run(cfg)
    except ConfigError as err:
        print(f"error: bad configuration: {err}", file=sys.stderr)
        return 2
    final = summary["final"]
    if int(os.environ.get("RANK", 0)) == 0:
        if final:
            print(f"done: {summary['steps']} steps, final loss {final['loss']:.4f}, "
                  f"{final['tokens_per_s']:.0f} tokens/s; metrics in {summary['metrics']}")  # fmt: skip
        else:
            print(f"done: nothing to train, the checkpoint is at train.steps={summary['steps']} already; "
                  f"metrics in {summary['metrics']}")  # fmt: skip
    return 0


def _shared_with_earlier_job(cfg, used: dict[str, int]) -> str | None:
    """In a sweep (jobs run one after another in this process): the error when this job's logging or
    checkpoint directory is one an earlier job used (its checkpoints would be resumed as this job's).
    Records this job's directories in ``used``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    job = int(hydra_cfg.job.num)
    for what in ("logging.dir", "checkpoint.dir"):
        value = cfg.logging.dir if what == "logging.dir" else cfg.checkpoint.dir
        if not value:
            continue
        key = os.path.abspath(str(value))
        if used.get(key, job) != job:
            return (f"{what}: {value} is also the {what} of job {used[key]} of this sweep: each job needs its own "
                    f"(leave {what} unset: each job writes into its own multirun/.../N, or make it depend on "
                    "${hydra:job.num})")  # fmt: skip
        used[key] = job
    return None


def _run_logged(cfg, used: dict[str, int]) -> int:
    """``_train`` with the console copied into the run's ``train.log`` (rank 0), a crash's traceback
    included."""
    import traceback

    from hydra.core.hydra_config import HydraConfig

    log = None
    if int(os.environ.get("RANK", 0)) == 0:
        hydra_cfg = HydraConfig.get()
        log = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"
    from .training.console_log import console_to_log

    with console_to_log(log) if log is not None else contextlib.nullcontext():
        try:
            shared = _shared_with_earlier_job(cfg, used)
            if shared:
                print(f"error: bad configuration: {shared}", file=sys.stderr)
                return 2
            return _train(cfg)
        except Exception:
            traceback.print_exc()
            return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point (also the ``primus-fp8-train`` console script): Hydra's command line (overrides,
    ``--help``, ``--cfg job|hydra|all``, ``-m``/``--multirun``, ...) and ``--version``. Exit status 2
    for a bad configuration (Hydra's composition errors, the start-up validation, a checkpoint that
    cannot be resumed, directories another run holds), 1 for a failed run."""
    if not (CONFIG_DIR / "config.yaml").is_file():
        print(f"error: config directory {CONFIG_DIR} not found (a broken install: reinstall primus-fp8-plugin)", file=sys.stderr)
        return 2
    given = list(sys.argv[1:] if argv is None else argv)
    if "--version" in given:
        from . import __version__

        print(f"primus-fp8-plugin {__version__}")
        return 0
    import hydra

    _register_schema()
    args = hydra_args(given, int(os.environ.get("RANK", 0)))
    state = {"started": False, "status": 0}
    used: dict[str, int] = {}  # directory -> the sweep job that used it

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def task(cfg) -> None:
        state["started"] = True
        status = _run_logged(cfg, used)
        if status:
            sys.exit(status)  # a sweep stops at its first failed job

    saved = sys.argv
    sys.argv = [saved[0] if saved and saved[0] else "primus_fp8_plugin.train", *args]
    try:
        task()
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
        if status == 1 and not state["started"]:  # Hydra reported a composition error (printed above)
            print("error: bad configuration (see above; --help lists the config groups and their options)", file=sys.stderr)
            return 2
        return status
    finally:
        sys.argv = saved
    return state["status"]


if __name__ == "__main__":
    sys.exit(main())
