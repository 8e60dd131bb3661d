"""Compose the trainer's Hydra configuration in-process (as ``python -m primus_fp8_plugin.train`` does),
for tests of the start-up checks that need no training process."""

from __future__ import annotations

from primus_fp8_plugin.train import CONFIG_DIR, compose

__all__ = ["CONFIG_DIR", "compose"]
