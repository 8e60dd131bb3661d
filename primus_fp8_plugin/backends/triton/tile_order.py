"""The order in which a 1-D grid of programs walks a grid of 128x128 tiles (the Gluon weight quantizer).

``group_rows`` tile rows walk the tile columns together, row fastest inside the group:
``group_rows == n_rows`` walks down each whole column of tiles first, ``group_rows == 1`` each tile
row left to right. A runtime argument so that orders can be compared without recompiling: on the
H200 no order was measurably faster than whole columns for the quantization kernels (a sweep of
1..32 rows, docs/PERFORMANCE.md, 2026-12-01 third session), which is what the wrapper passes.
``group_rows * n_cols`` must fit in int32."""

import triton
import triton.language as tl


@triton.jit
def tile_coords(pid, n_rows, n_cols, group_rows):
    """(tile row, tile column) of program ``pid`` (0 <= pid < n_rows * n_cols)."""
    per_group = group_rows * n_cols
    first = (pid // per_group) * group_rows
    size = tl.minimum(n_rows - first, group_rows)
    within = pid % per_group
    return first + within % size, within // size
