"""The backends by name: plain data, no torch (the run configuration's schema imports it to check
``backend.name`` without importing any backend).

Adding a backend is one sub-module plus one ``BACKENDS`` line; the registry (``backends/__init__.py``)
and the config schema both read this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendEntry:
    module: str  # imported lazily, so an absent optional dependency costs nothing until asked for
    cls: str
    auto_rank: int  # lower = preferred by "auto" (fastest correct first)


BACKENDS: dict[str, BackendEntry] = {
    "flydsl": BackendEntry("primus_fp8_plugin.backends.flydsl", "FlydslBackend", auto_rank=4),
    # hopper: per GEMM the faster of the two below
    "hopper": BackendEntry("primus_fp8_plugin.backends.hopper", "HopperBackend", auto_rank=3),
    "cublas": BackendEntry("primus_fp8_plugin.backends.cublas", "CublasBackend", auto_rank=5),
    "triton": BackendEntry("primus_fp8_plugin.backends.triton", "TritonBackend", auto_rank=10),
    "reference": BackendEntry("primus_fp8_plugin.backends.reference", "ReferenceBackend", auto_rank=100),
}


def backend_names(table: dict[str, BackendEntry] = BACKENDS) -> list[str]:
    """Every backend name in ``table``, in ``auto`` preference order."""
    return sorted(table, key=lambda n: table[n].auto_rank)
