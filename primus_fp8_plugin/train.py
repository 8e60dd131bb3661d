"""Train a GPT with Megatron-core and FP8 blockwise linears: a Hydra application.

    python -m primus_fp8_plugin.train                               # the embedded default (CPU or GPU)
    python -m primus_fp8_plugin.train fp8=bf16 model=gpt_125m parallel.tp=2 train.steps=2000
    python -m primus_fp8_plugin.train --help                        # groups, options, the composed config
    python -m primus_fp8_plugin.train --cfg job                     # print the composed config, do not run
    python -m primus_fp8_plugin.train -m fp8=bf16,blockwise train.steps=100   # a sweep: one run per value
    torchrun --nproc-per-node 2 -m primus_fp8_plugin.train parallel=tp2_sp

The config tree is ``configs/`` (groups model, fp8, backend, parallel, data, train, checkpoint,
logging; shipped inside the package as ``primus_fp8_plugin/configs``); the schema is
``primus_fp8_plugin/config/schema.py``. A bad value stops the run at start-up with a message naming
the field and exit status 2.

Output directory: each run gets its own, ``outputs/DATE/TIME`` (a sweep: ``multirun/DATE/TIME/N``),
holding ``metrics.jsonl``, Hydra's ``.hydra/`` (composed config, overrides) and ``train.log``.
``logging.dir=DIR`` on the command line makes ``DIR`` the run's output directory instead (in a
sweep every run then writes its metrics to ``DIR``). Relative paths (``data.cache_dir``,
``checkpoint.dir``) are relative to the directory the command runs in.
"""

from __future__ import annotations

import logging
import os
import sys
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


def _quiet_megatron() -> None:
    # Megatron's notices about absent apex/TE fallbacks and GPTModel's deprecation are not the user's business.
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE).*")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _is_multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in args)


def _override_value(args: list[str], key: str) -> str | None:
    """The raw value of the last ``key=...`` (also ``+key=``, ``++key=``) among the overrides."""
    found = None
    for a in args:
        name, eq, value = a.lstrip("+").partition("=")
        if eq and name == key:
            found = value
    return found


def hydra_args(args: list[str], rank: int) -> list[str]:
    """The command line given to Hydra: ``args`` plus where this process's Hydra output goes.

    One run, ``logging.dir=DIR`` given: ``DIR`` is also Hydra's run directory (one directory per
    run). Ranks other than 0 of a torchrun job write no Hydra output (no ``.hydra/``, no log file,
    no timestamped directory of their own); rank 0's directory holds the run's outputs."""
    args = list(args)
    if rank != 0:
        return [*args, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    log_dir = _override_value(args, "logging.dir")
    if log_dir is not None and not _is_multirun(args) and _override_value(args, "hydra.run.dir") is None:
        args.append(f"hydra.run.dir={log_dir}")
    return args


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
    if final and int(os.environ.get("RANK", 0)) == 0:
        print(f"done: {summary['steps']} steps, final loss {final['loss']:.4f}, "
              f"{final['tokens_per_s']:.0f} tokens/s; metrics in {summary['metrics']}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point (also the ``primus-fp8-train`` console script): Hydra's command line (overrides,
    ``--help``, ``--cfg job|hydra|all``, ``-m``/``--multirun``, ...). Exit status 2 for a bad
    configuration (Hydra's composition errors and the start-up validation), 1 for a failed run."""
    if not (CONFIG_DIR / "config.yaml").is_file():
        print(f"error: config directory {CONFIG_DIR} not found (a broken install: reinstall primus-fp8-plugin)", file=sys.stderr)
        return 2
    import hydra

    _register_schema()
    args = hydra_args(list(sys.argv[1:] if argv is None else argv), int(os.environ.get("RANK", 0)))
    state = {"started": False, "status": 0}

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def task(cfg) -> None:
        state["started"] = True
        status = _train(cfg)
        if status:
            sys.exit(status)  # a sweep stops at its first bad configuration

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
