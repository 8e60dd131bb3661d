"""The one backend registry: a backend name -> its kernels, availability and ``auto`` resolution.

Adding a backend is one sub-module plus one line in ``names.BACKENDS`` (the table this registry and
the config schema read); nothing outside these two files branches on backend names.
"""

from __future__ import annotations

import importlib

import torch

from . import names
from .base import Availability, Backend

__all__ = [
    "Availability",
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "backend_availability",
    "backend_names",
    "get_backend",
]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (the message says why and what to use)."""


_REGISTRY: dict[str, names.BackendEntry] = dict(names.BACKENDS)  # a copy, so that tests can extend it

_INSTANCES: dict[str, Backend] = {}
# Availability cannot change within a process (device, drivers, imports, TRITON_INTERPRET are fixed),
# and "auto" is resolved on every layer call: answer each (name, device) once.
_AVAILABILITY: dict[tuple, Availability | str] = {}  # (name, device) -> Availability; ("auto", device, None) -> name


def backend_names() -> list[str]:
    """Every registered backend name, in ``auto`` preference order."""
    return names.backend_names(_REGISTRY)


def _load(name: str) -> Backend | Availability:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *backend_names()]}")
    if name not in _INSTANCES:
        entry = _REGISTRY[name]
        try:
            module = importlib.import_module(entry.module)
        except ImportError as err:  # an optional dependency is missing
            return Availability(False, f"backend {name!r} could not be imported: {err}")
        _INSTANCES[name] = getattr(module, entry.cls)()
    return _INSTANCES[name]


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def backend_availability(name: str, device: torch.device | str | None = None) -> Availability:
    """Whether backend ``name`` can run on ``device`` (default: the current CUDA device, else CPU)."""
    dev = _as_device(device)
    key = (name, dev)
    if key not in _AVAILABILITY:
        loaded = _load(name)
        _AVAILABILITY[key] = loaded if isinstance(loaded, Availability) else loaded.availability(dev)
    return _AVAILABILITY[key]


def available_backends(device: torch.device | str | None = None) -> dict[str, Availability]:
    """Availability of every registered backend on ``device``, in ``auto`` preference order."""
    return {name: backend_availability(name, device) for name in backend_names()}


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> Backend:
    """The backend called ``name`` for ``device``; ``"auto"`` picks the preferred available one.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the named backend cannot run on ``device`` (says why).
    """
    dev = _as_device(device)
    if name == "auto":
        # the choice follows from the cached availabilities: kept beside them (a 3-tuple key, so that it
        # never answers backend_availability), and dropped with them
        chosen = _AVAILABILITY.get(("auto", dev, None))
        if chosen is not None:
            return _INSTANCES[chosen]
        reasons = []
        for candidate in backend_names():
            avail = backend_availability(candidate, dev)
            if avail and avail.auto:
                _AVAILABILITY[("auto", dev, None)] = candidate
                return _INSTANCES[candidate]
            reasons.append(f"{candidate}: {avail.reason or 'not chosen automatically'}")
        raise BackendUnavailableError(f"no backend can run on {dev}: " + "; ".join(reasons))
    avail = backend_availability(name, dev)
    if not avail:
        usable = [n for n, a in available_backends(dev).items() if a]
        raise BackendUnavailableError(f"backend {name!r} is not available on {dev}: {avail.reason}. Available here: {usable}")
    return _INSTANCES[name]
