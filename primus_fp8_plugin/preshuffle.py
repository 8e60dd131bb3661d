"""FlyDSL's (16, 16) preshuffled layout of an FP8 GEMM operand, and the checks of which shapes it holds.

A B operand ``[R, C]`` (C the contraction dim: W ``[N, K]`` for fprop, W^T ``[K, N]`` for dgrad) is
stored as 16x16 byte tiles: the tiles in row-major tile order, each tile's 16 rows of 16 contiguous
bytes one after the other. As a view: ``B.view(R/16, 16, C/32, 2, 16).permute(0, 2, 3, 1, 4)``
(FlyDSL's ``shuffle_weight(x, layout=(16, 16))`` for 1-byte types), i.e. element ``(r, c)`` lives at
byte ``((((r//16)*(C/32) + c//32)*2 + (c%32)//16)*16 + r%16)*16 + c%16``
``= ((r//16)*(C/16) + c//16)*256 + (r%16)*16 + c%16``. A lane of the FP8 MFMA that owns row ``r``
reads its 16 K-bytes of a tile with one 128-bit load, and the 16 lanes of a row group read one
contiguous 256-byte line.

The layout needs ``R % 16 == 0`` and ``C % 32 == 0``. A weight ``[N, K]`` is stored preshuffled
(both copies) only where both copies fit: ``N % 32 == 0`` and ``K % 32 == 0``
(:func:`preshuffle_fits`); :func:`check_preshuffle_shape` raises for the others. The tensor keeps its
logical shape ``[R, C]`` and stays contiguous; only the byte order differs.

Row padding (:func:`padded_rows`): row tiles are the layout's outermost index, so a preshuffled
``[R, C]`` operand followed by ``(R_pad - R) * C`` zero bytes is the preshuffled ``[R_pad, C]``
operand with zero rows. The weight quantizer keeps W^T's copy in such a storage when the padding
lets dgrad use 256-wide output tiles (``DGRAD_ROW_MULTIPLE``); the tensor itself stays ``[R, C]``.
"""

from __future__ import annotations

import torch

PRESHUFFLE16 = "preshuffle16"
K_MAJOR = "k_major"
LAYOUTS = (K_MAJOR, PRESHUFFLE16)
TILE_ROWS, VIEW_COLS = 16, 32  # the layout's divisibility: rows % 16, contraction dim % 32
DGRAD_ROW_MULTIPLE = 256  # W^T's rows (dgrad's output columns) padded to this where it is a multiple of 128 only


def dgrad_padded_rows(k: int) -> int:
    """W^T's padded row count for a weight with ``k`` columns: ``k`` rounded up to 256 when ``k % 256 == 128``
    (the padding then turns dgrad's last 128-wide output tile into a 256-wide one), else ``k``."""
    return k + 128 if k % DGRAD_ROW_MULTIPLE == 128 else k


def padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``t`` [R, C] (contiguous, at the start of its storage) seen as ``[rows, C]`` over the same storage,
    or None when the storage does not hold ``rows`` rows (a copy of the tensor drops the padding)."""
    r, c = t.shape
    if rows == r:
        return t
    if rows < r or not t.is_contiguous() or t.storage_offset() != 0:
        return None
    if t.untyped_storage().nbytes() < rows * c * t.element_size():
        return None
    return t.as_strided((rows, c), (c, 1))


def check_preshuffle_shape(rows: int, cols: int, what: str = "operand") -> None:
    """Raise ValueError unless ``[rows, cols]`` (cols the contraction dim) fits the (16, 16) layout."""
    if rows % TILE_ROWS or cols % VIEW_COLS or rows <= 0 or cols <= 0:
        raise ValueError(
            f"{what} [{rows}, {cols}] cannot be stored in the (16, 16) preshuffled layout: it needs rows % 16 == 0 "
            f"and the contraction dim % 32 == 0; keep it K-major (layout='{K_MAJOR}') or pad the weight"
        )


def preshuffle_fits(n: int, k: int) -> bool:
    """Whether both copies of a weight ``[N, K]`` (W and W^T) fit the preshuffled layout."""
    return n > 0 and k > 0 and n % VIEW_COLS == 0 and k % VIEW_COLS == 0


def preshuffle(b: torch.Tensor) -> torch.Tensor:
    """A K-major ``[R, C]`` tensor in the (16, 16) preshuffled byte order (same shape, contiguous)."""
    r, c = b.shape
    check_preshuffle_shape(r, c)
    return b.reshape(r // 16, 16, c // 32, 2, 16).permute(0, 2, 3, 1, 4).contiguous().reshape(r, c)


def unshuffle(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`preshuffle`: the K-major ``[R, C]`` tensor."""
    r, c = b.shape
    check_preshuffle_shape(r, c)
    return b.reshape(r // 16, c // 32, 2, 16, 16).permute(0, 3, 1, 2, 4).contiguous().reshape(r, c)


def preshuffle_offset(r, c, cols: int):
    """Byte offset of element ``(r, c)`` in a preshuffled ``[rows, cols]`` operand (ints or tensors)."""
    return ((r // 16) * (cols // 16) + c // 16) * 256 + (r % 16) * 16 + c % 16
