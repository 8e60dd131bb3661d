"""Structured configuration of training runs (Hydra schema + start-up validation)."""

from .schema import Config, ConfigError, validate

__all__ = ["Config", "ConfigError", "validate"]
