"""Launch variants of the fused-op kernels (norm statistics, norm backward, the Hopper fused quantizer).

Every variant of a kernel computes the same bits: they differ only in how the work is laid out over
programs, warps and registers (rows per program, columns loaded per loop step, how many column halves
of a tile are produced at a time), never in the order of any floating-point operation. The tests
run every variant against the spec (``reference_fused.py``); ``benchmarks/bench_fused.py --variants``
times all of them, so that the default below is the measured best.

``ACTIVE`` holds the variant each kernel launches; ``use(kind, name)`` changes it (process-wide), and
``PRIMUS_FP8_FUSED_VARIANTS="stats=u4,bwd=wide,gluon=halves"`` sets it at import.

Resources on sm_90 (``python -m tools.aot_triton --gluon fused_act``; the Triton kernels through
``aot_fused.py``), bf16: the fused SwiGLU quantizer issues about 4,500 instructions per thread per
128x128 tile (about 70 per element: the spec's exp polynomial and IEEE divisions, no FMA), so at
8192x14336 it is bound by instruction issue near 280 us rather than by its 712 MB of traffic (about
180 us at copy bandwidth); with ``parts=1`` it needs 187 registers (one 8-warp program per SM), with
``halves`` 128 (two). Norm statistics: LayerNorm 64 registers (``base``), 96 (``u4``). Norm
backward: 96 (``base``, a barrier per column sum in its loop), 243 LayerNorm / 150 RMSNorm (``wide``,
no exchange between warps in the loop).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class StatsConfig:
    """``norm._stats_kernel``: ``rows`` per program, ``unroll`` 128-column chunks loaded per loop step
    (all issued before the row sums take them in column order), ``warps``."""

    rows: int
    unroll: int
    warps: int


@dataclass(frozen=True)
class BwdConfig:
    """``norm._bwd_kernel`` (a program per 16-row group, fixed by the spec's column sums):
    ``unroll`` 128-column chunks per step of the first pass (the row sums); ``width`` columns per step
    of the second pass (dx and the group's column sums), taken ``sub`` rows at a time (4, 8 or 16);
    a width of 256 * warps puts all ``sub`` rows of 8 columns in one thread, so the column sums need
    no exchange between threads (at most ``width`` = the row length rounded up to a power of 2 is
    used); ``reverse``: the second pass walks the row backwards, starting with the columns the first
    pass read last (still in L2); ``warps``; ``colsum_cols``: columns per program of the kernel that
    sums the groups; ``stages``: Triton's ``num_stages`` (software pipelining of the loops' loads,
    which costs registers)."""

    unroll: int
    width: int
    sub: int
    reverse: bool
    warps: int
    colsum_cols: int
    stages: int = 3


@dataclass(frozen=True)
class GluonConfig:
    """``fused_act_gluon``'s kernel: ``parts`` = 1 produces the 128x128 tile at once, 2 in two 128x64
    column halves (fewer live registers while the producer runs: SwiGLU's needs ~190 at once, one
    program per SM). ``swiglu_maxnreg`` / ``norm_maxnreg``: the register cap passed to the compiler
    for 2-byte inputs writing both FP8 copies (the training case; checked spill-free ahead of time by
    ``tools.aot_triton --gluon fused_act``); None, and every other case: the compiler's choice."""

    parts: int
    swiglu_maxnreg: int | None = None
    norm_maxnreg: int | None = None

    def maxnreg(self, swiglu: bool, element_size: int, rowwise: bool, columnwise: bool) -> int | None:
        if element_size != 2 or not (rowwise and columnwise):
            return None
        return self.swiglu_maxnreg if swiglu else self.norm_maxnreg


STATS = {
    "base": StatsConfig(rows=16, unroll=1, warps=4),
    "u4": StatsConfig(rows=16, unroll=4, warps=4),
    "r8u4": StatsConfig(rows=8, unroll=4, warps=4),
}
BWD = {
    "base": BwdConfig(unroll=1, width=128, sub=16, reverse=False, warps=4, colsum_cols=32),
    "base_u4": BwdConfig(unroll=4, width=128, sub=16, reverse=True, warps=4, colsum_cols=16),
    "wide": BwdConfig(unroll=1, width=1024, sub=4, reverse=False, warps=4, colsum_cols=16, stages=1),
}
GLUON = {
    "base": GluonConfig(parts=1),
    "halves": GluonConfig(parts=2, swiglu_maxnreg=128),
}
TABLES = {"stats": STATS, "bwd": BWD, "gluon": GLUON}

ACTIVE = {"stats": "u4", "bwd": "wide", "gluon": "halves"}
"""The variant each kernel launches (names in ``TABLES``)."""


def use(kind: str, name: str) -> None:
    """Make ``name`` the variant that ``kind`` ('stats', 'bwd', 'gluon') launches from now on."""
    if kind not in TABLES:
        raise ValueError(f"kernel kind must be one of {sorted(TABLES)}, got {kind!r}")
    if name not in TABLES[kind]:
        raise ValueError(f"{kind} variants are {sorted(TABLES[kind])}, got {name!r}")
    ACTIVE[kind] = name


@contextlib.contextmanager
def variant(kind: str, name: str):
    """``use(kind, name)`` inside a ``with`` block, the previous variant restored after it."""
    before = ACTIVE[kind]
    use(kind, name)
    try:
        yield
    finally:
        ACTIVE[kind] = before


def stats_config() -> StatsConfig:
    return STATS[ACTIVE["stats"]]


def bwd_config() -> BwdConfig:
    return BWD[ACTIVE["bwd"]]


def gluon_config() -> GluonConfig:
    return GLUON[ACTIVE["gluon"]]


def _from_env(text: str) -> None:
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, name = item.partition("=")
        use(kind.strip(), name.strip())


_from_env(os.environ.get("PRIMUS_FP8_FUSED_VARIANTS", ""))
