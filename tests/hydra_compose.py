"""Compose the trainer's Hydra configuration in-process (as ``python -m primus_fp8_plugin.train`` does),
for tests of the start-up checks that need no training process."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose(*overrides: str):
    """The read-only DictConfig of ``configs/config.yaml`` with ``overrides`` (Hydra syntax) applied."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from primus_fp8_plugin.config.schema import Config

    ConfigStore.instance().store(name="schema", node=Config)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg
