"""The tile schedules of the Hopper Gluon GEMMs, dense and grouped side by side: which output tile each
step of a persistent program computes.

Dense (``gemm.py``): ``tile_grid`` counts the tiles and K blocks; ``tile_coords`` walks them in an
L2-grouped order (``GROUP_M`` rows of tiles sweep the N tiles together).

Grouped (``gemm_grouped.py``), from the ``GroupLayout`` on the device, no host synchronisation: fwd/dgrad
(``fwd_tile``): expert ``e`` owns tiles ``padded[e]/128 * NT .. padded[e+1]/128 * NT`` (``NT`` N tiles),
walked in the dense order within the expert; a tile finds its expert by a binary search of the padded
offsets (``find_expert``, ``log2_experts`` steps). wgrad (``wgrad_tile``): ``E x MT x NT`` tiles,
expert-major, the dense order within each expert.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def tile_grid(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr):
    # output tiles per column and row, their count, and K blocks: what every partition walks
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    return num_pid_m, num_pid_n, num_pid_m * num_pid_n, gl.cdiv(K, BK)


@gluon.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    # L2-friendly order: GROUP_M rows of tiles sweep the N tiles together.
    width = GROUP_M * num_pid_n
    group = tile // width
    first_m = group * GROUP_M
    group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_size
    pid_n = (tile % width) // group_size
    return pid_m, pid_n


@gluon.jit
def find_expert(padded_ptr, row, E, LOG_E: gl.constexpr):
    """The largest ``e < E`` with ``padded[e] <= row`` (``row < padded[E]``): the expert whose padded rows
    hold ``row`` (empty experts share their successor's start and are passed over)."""
    lo = E * 0
    hi = E
    for _ in gl.static_range(LOG_E):
        mid = (lo + hi) // 2
        if gl.load(padded_ptr + mid) <= row:
            lo = mid
        else:
            hi = mid
    return lo


@gluon.jit
def fwd_tile(tile, offsets_ptr, padded_ptr, E, num_pid_n, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr,
              LOG_E: gl.constexpr):  # fmt: skip
    """(expert, first token row, the expert's end row, N tile) of fwd/dgrad tile ``tile``."""
    g = tile // num_pid_n  # the tile's padded row tile: expert e owns padded[e]/128 .. padded[e+1]/128
    e = find_expert(padded_ptr, g * BLOCK_M, E, LOG_E)
    p0 = gl.load(padded_ptr + e) // BLOCK_M
    mt = gl.load(padded_ptr + e + 1) // BLOCK_M - p0
    pid_m, pid_n = tile_coords(tile - p0 * num_pid_n, mt, num_pid_n, GROUP_M)
    row0 = gl.load(offsets_ptr + e) + pid_m * BLOCK_M
    end = gl.load(offsets_ptr + e + 1)
    return e, row0, end, pid_n


@gluon.jit
def wgrad_tile(tile, offsets_ptr, padded_ptr, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BK: gl.constexpr):
    """(expert, M tile, N tile, K blocks, first token column) of wgrad tile ``tile`` (expert-major)."""
    per_expert = num_pid_m * num_pid_n
    e = tile // per_expert
    pid_m, pid_n = tile_coords(tile - e * per_expert, num_pid_m, num_pid_n, GROUP_M)
    tokens = gl.load(offsets_ptr + e + 1) - gl.load(offsets_ptr + e)
    col0 = gl.load(padded_ptr + e)  # a multiple of 128
    return e, pid_m, pid_n, gl.cdiv(tokens, BK), col0


def log2_experts(num_groups: int) -> int:
    """Steps of the binary search over ``num_groups`` experts (``find_expert``): ceil(log2(E))."""
    return max(num_groups - 1, 0).bit_length()
