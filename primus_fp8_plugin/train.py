"""Train a GPT with Megatron-core and FP8 blockwise linears, configured by Hydra.

    python -m primus_fp8_plugin.train                               # the embedded default (CPU or GPU)
    python -m primus_fp8_plugin.train fp8=bf16 model=gpt_125m parallel.tp=2 train.steps=2000
    torchrun --nproc-per-node 2 -m primus_fp8_plugin.train parallel=tp2_sp

The config tree is ``configs/`` (groups model, fp8, backend, parallel, data, train, checkpoint,
logging); the schema is ``primus_fp8_plugin/config/schema.py``. A bad value stops the run at
start-up with a message naming the field.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    from .config.schema import Config

    ConfigStore.instance().store(name="schema", node=Config)


def main(argv: list[str] | None = None) -> int:
    """Entry point (also the ``primus-fp8-train`` console script)."""
    if not CONFIG_DIR.is_dir():
        print(f"error: config directory {CONFIG_DIR} not found (run from a checkout of primus-fp8-plugin)", file=sys.stderr)
        return 2
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .config import ConfigError
    from .config.schema import composition_error_message

    # Megatron's notices about absent apex/TE fallbacks and GPTModel's deprecation are not the user's business.
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE).*")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    _register_schema()
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        OmegaConf.set_readonly(cfg, True)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: bad configuration: {composition_error_message(err)}", file=sys.stderr)
        return 2
    from .training.loop import run

    try:
        summary = run(cfg)
    except ConfigError as err:
        print(f"error: bad configuration: {err}", file=sys.stderr)
        return 2
    final = summary["final"]
    if final:
        print(f"done: {summary['steps']} steps, final loss {final['loss']:.4f}, "
              f"{final['tokens_per_s']:.0f} tokens/s; metrics in {summary['metrics']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
