"""The order in which a 1-D grid of programs walks a grid of 128x128 tiles (quantization kernels).

Programs that run at the same time touch neighbouring tiles, so the order decides how the HBM
traffic of one wave is laid out: ``group_rows`` tile rows walk the tile columns together, row
fastest inside the group. ``group_rows >= n_rows`` walks down each whole column of tiles first
(tiles of one column are 128-byte slices of many rows); ``group_rows == 1`` walks each tile row
left to right (contiguous reads of X, scattered writes of X^T). A runtime argument, so that a sweep
needs no recompilation (``scripts/bench_quant.py --orders``)."""

import triton
import triton.language as tl


def group_rows_arg(requested: int, n_rows: int) -> int:
    """The kernel argument for ``requested`` tile rows per group (0: all rows, i.e. column first),
    clamped to ``n_rows`` so that ``group_rows * n_cols`` stays within int32."""
    return n_rows if requested <= 0 else min(requested, n_rows)


@triton.jit
def tile_coords(pid, n_rows, n_cols, group_rows):
    """(tile row, tile column) of program ``pid`` (0 <= pid < n_rows * n_cols)."""
    per_group = group_rows * n_cols
    first = (pid // per_group) * group_rows
    size = tl.minimum(n_rows - first, group_rows)
    within = pid % per_group
    return first + within % size, within // size
