"""The quantized-tensor type: FP8 data, fp32 inverse scales, tile shape, and which copies exist.

Layouts are stated here once and checked at every kernel boundary (``BlockwiseFp8Tensor.check``).

A 2-D high-precision tensor ``x [R, C]`` is quantized into up to two *copies*:

* the **rowwise** copy: ``data [R, C]``, tiles run along C (the last dim);
* the **columnwise** copy: ``data [C, R]`` (= x^T, contiguous), tiles run along R.

Both are "K-major": the contraction dimension of the GEMM that consumes the copy is the
contiguous one, as Hopper FP8 tensor cores require.

For 1D scaling (1x128 tiles) the columnwise copy is quantized separately from the high-precision
input over 128x1 tiles (it is *not* the transpose of the rowwise FP8 data). For 2D scaling
(128x128 blocks) the columnwise copy is the exact transpose of the rowwise data and scales.

Inverse scales (``scale_inv``, fp32) use Transformer Engine's GEMM-ready layouts, where
``pad4(n)`` rounds up to a multiple of 4 and ``D = [rows, cols]`` is the shape of the stored copy:

=========  ============================================  ========================================
block_dim  scale_inv shape                               entry [i, j] belongs to
=========  ============================================  ========================================
1          ``[ceil(cols/128), pad4(rows)]``              row j, columns 128*i .. 128*i+127
2          ``[ceil(rows/128), pad4(ceil(cols/128))]``    rows 128*i.., columns 128*j..
=========  ============================================  ========================================

So for X [M, K]: rowwise scales are ``[ceil(K/128), pad4(M)]`` and columnwise scales
``[ceil(M/128), pad4(K)]``; for W [N, K]: ``[ceil(N/128), pad4(ceil(K/128))]`` and
``[ceil(K/128), pad4(ceil(N/128))]``. Padding entries hold 1.0 here (TE leaves them unspecified);
kernels never read them for their value. Because the layout *is* TE's, conversion to and from TE
(``to_te`` / ``from_te``) is a checked re-labelling, not a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .preshuffle import K_MAJOR, LAYOUTS, PRESHUFFLE16, check_preshuffle_shape, unshuffle
from .recipe import BLOCK

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pad4(n: int) -> int:
    return ceil_div(n, 4) * 4


def scale_inv_shape(rows: int, cols: int, block_dim: int) -> tuple[int, int]:
    """TE's GEMM-ready ``scale_inv`` shape for a stored copy of shape ``[rows, cols]``."""
    if block_dim == 1:
        return (ceil_div(cols, BLOCK), pad4(rows))
    if block_dim == 2:
        return (ceil_div(rows, BLOCK), pad4(ceil_div(cols, BLOCK)))
    raise ValueError(f"block_dim must be 1 or 2, got {block_dim}")


def compact_scale_shape(rows: int, cols: int, block_dim: int) -> tuple[int, int]:
    """Shape of the per-tile scales in tile-grid order (no padding), for a copy ``[rows, cols]``.

    1D: ``[rows, ceil(cols/128)]``; 2D: ``[ceil(rows/128), ceil(cols/128)]``.
    """
    if block_dim == 1:
        return (rows, ceil_div(cols, BLOCK))
    return (ceil_div(rows, BLOCK), ceil_div(cols, BLOCK))


def scales_to_te_layout(compact: torch.Tensor, rows: int, cols: int, block_dim: int) -> torch.Tensor:
    """Pack per-tile scales (``compact_scale_shape`` order) into TE's layout, padding with 1.0."""
    out = torch.ones(scale_inv_shape(rows, cols, block_dim), dtype=torch.float32, device=compact.device)
    if block_dim == 1:
        out[:, :rows] = compact.t()
    else:
        out[:, : compact.shape[1]] = compact
    return out


def transpose_blocks(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The columnwise copy of a 128x128-block (2D) quantized copy: its exact transpose, data and scales (the reference
    form; ``kernels/triton/transpose_weight.py`` computes the same bits).

    ``data [..., R, C]`` FP8 (K-major), ``scale_inv [..., ceil(R/128), pad4(ceil(C/128))]`` (TE's 2D layout; leading
    dims: experts) -> ``(data^T [..., C, R]`` contiguous, ``scale_inv [..., ceil(C/128), pad4(ceil(R/128))]`` with
    1.0 in the padding entries). Every block keeps its bytes and its scale, so the pair dequantizes to the transpose
    of what the rowwise pair dequantizes to, bit for bit (docs/NUMERICS.md)."""
    rows, cols = data.shape[-2:]
    rb, cb = ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)
    t_scale = torch.ones(*scale_inv.shape[:-2], cb, pad4(rb), dtype=torch.float32, device=scale_inv.device)
    t_scale[..., :rb] = scale_inv[..., :cb].transpose(-1, -2)
    return data.transpose(-1, -2).contiguous(), t_scale


def scales_from_te_layout(te_scale: torch.Tensor, rows: int, cols: int, block_dim: int) -> torch.Tensor:
    """The real entries of a TE-layout ``scale_inv``, in ``compact_scale_shape`` order (a view)."""
    if block_dim == 1:
        return te_scale[:, :rows].t()
    return te_scale[:, : ceil_div(cols, BLOCK)]


@dataclass
class BlockwiseFp8Tensor:
    """A 2-D tensor quantized to FP8 with per-tile scales; holds a rowwise and/or columnwise copy.

    Attributes:
        shape: logical shape ``(R, C)`` of the high-precision tensor.
        block_dim: 1 (1x128 tiles; columnwise copy uses 128x1 tiles) or 2 (128x128 blocks).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        orig_dtype: dtype of the high-precision source (default target of ``dequantize``).
        rowwise_data: ``[R, C]`` FP8, contiguous, or None.
        rowwise_scale_inv: fp32, ``scale_inv_shape(R, C, block_dim)``, or None.
        columnwise_data: ``[C, R]`` FP8 (x^T), contiguous, or None.
        columnwise_scale_inv: fp32, ``scale_inv_shape(C, R, block_dim)``, or None.

        layout: ``"k_major"`` (the default: the copies as above) or ``"preshuffle16"``: both data
            copies hold the same values in FlyDSL's (16, 16) preshuffled byte order
            (``preshuffle.py``; 2D scaling only, each copy's rows % 16 and columns % 32). Shapes and
            scales are unchanged; ``dequantize`` and ``to_te`` undo the shuffle.

    The inverse scale of a tile is NaN when the tile held NaN or +-Inf (its data is then NaN).
    """

    shape: tuple[int, int]
    block_dim: int
    fp8_dtype: torch.dtype
    orig_dtype: torch.dtype
    rowwise_data: torch.Tensor | None = None
    rowwise_scale_inv: torch.Tensor | None = None
    columnwise_data: torch.Tensor | None = None
    columnwise_scale_inv: torch.Tensor | None = None
    layout: str = K_MAJOR

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.check()

    # ---- layout ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ValueError if any stored copy breaks the layout contract in the module docstring."""
        rows, cols = self.shape
        if self.block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 or 2, got {self.block_dim}")
        if self.fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {self.fp8_dtype}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == PRESHUFFLE16 and self.block_dim != 2:
            raise ValueError("the preshuffled layout holds 2D-scaled (128x128) weights only")
        if self.rowwise_data is None and self.columnwise_data is None:
            raise ValueError("a BlockwiseFp8Tensor needs a rowwise or a columnwise copy (or both)")
        copies = (
            ("rowwise", self.rowwise_data, self.rowwise_scale_inv, (rows, cols)),
            ("columnwise", self.columnwise_data, self.columnwise_scale_inv, (cols, rows)),
        )
        device = None
        for name, data, scale, (r, c) in copies:
            if (data is None) != (scale is None):
                raise ValueError(f"{name}: data and scale_inv must both be given or both be None")
            if data is None:
                continue
            if data.dtype != self.fp8_dtype:
                raise ValueError(f"{name}_data has dtype {data.dtype}, expected {self.fp8_dtype}")
            if tuple(data.shape) != (r, c):
                raise ValueError(f"{name}_data has shape {tuple(data.shape)}, expected {(r, c)}")
            if not data.is_contiguous():
                raise ValueError(f"{name}_data must be contiguous")
            if self.layout == PRESHUFFLE16:
                check_preshuffle_shape(r, c, f"{name}_data")
            want = scale_inv_shape(r, c, self.block_dim)
            if scale.dtype != torch.float32 or tuple(scale.shape) != want:
                raise ValueError(
                    f"{name}_scale_inv must be float32 of shape {want} (TE layout), got {scale.dtype} {tuple(scale.shape)}"
                )
            if not scale.is_contiguous():
                raise ValueError(f"{name}_scale_inv must be contiguous")
            for t in (data, scale):
                if device is None:
                    device = t.device
                elif t.device != device:
                    raise ValueError(f"all parts must be on one device, found {device} and {t.device}")

    @property
    def device(self) -> torch.device:
        data = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return data.device

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored data and scales."""
        parts = (self.rowwise_data, self.rowwise_scale_inv, self.columnwise_data, self.columnwise_scale_inv)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def k_major(self) -> BlockwiseFp8Tensor:
        """This tensor with K-major copies (itself when it is K-major; otherwise unshuffled copies)."""
        if self.layout == K_MAJOR:
            return self
        row = None if self.rowwise_data is None else unshuffle(self.rowwise_data)
        col = None if self.columnwise_data is None else unshuffle(self.columnwise_data)
        return BlockwiseFp8Tensor(
            self.shape, self.block_dim, self.fp8_dtype, self.orig_dtype, rowwise_data=row,
            rowwise_scale_inv=self.rowwise_scale_inv, columnwise_data=col, columnwise_scale_inv=self.columnwise_scale_inv,
        )  # fmt: skip

    def rowwise_only(self) -> BlockwiseFp8Tensor:
        """This tensor without its columnwise copy (the same rowwise buffers); itself when it has none."""
        if self.columnwise_data is None:
            return self
        return BlockwiseFp8Tensor(self.shape, self.block_dim, self.fp8_dtype, self.orig_dtype, rowwise_data=self.rowwise_data,
                                  rowwise_scale_inv=self.rowwise_scale_inv, layout=self.layout)  # fmt: skip

    def with_columnwise(self, data: torch.Tensor, scale_inv: torch.Tensor) -> BlockwiseFp8Tensor:
        """This tensor's rowwise copy with ``data`` / ``scale_inv`` as its columnwise copy (checked)."""
        return BlockwiseFp8Tensor(self.shape, self.block_dim, self.fp8_dtype, self.orig_dtype, rowwise_data=self.rowwise_data,
                                  rowwise_scale_inv=self.rowwise_scale_inv, columnwise_data=data,
                                  columnwise_scale_inv=scale_inv, layout=self.layout)  # fmt: skip

    def _copy(self, which: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        if which == "rowwise":
            data, scale, (r, c) = self.rowwise_data, self.rowwise_scale_inv, self.shape
        elif which == "columnwise":
            data, scale, (c, r) = self.columnwise_data, self.columnwise_scale_inv, self.shape
        else:
            raise ValueError(f"copy must be 'rowwise' or 'columnwise', got {which!r}")
        if data is None:
            raise ValueError(f"this tensor holds no {which} copy")
        return data, scale, r, c

    def scales(self, which: str = "rowwise") -> torch.Tensor:
        """Per-tile inverse scales of one copy in tile-grid order, without padding (a view).

        For a stored copy ``[r, c]``: 1D -> ``[r, ceil(c/128)]``; 2D -> ``[ceil(r/128), ceil(c/128)]``.
        """
        _, scale, r, c = self._copy(which)
        return scales_from_te_layout(scale, r, c, self.block_dim)

    def dequantize(self, dtype: torch.dtype | None = None, copy: str | None = None) -> torch.Tensor:
        """High-precision ``[R, C]`` tensor from one copy (rowwise if present, else columnwise)."""
        if self.layout != K_MAJOR:
            return self.k_major().dequantize(dtype, copy)
        which = copy or ("rowwise" if self.has_rowwise else "columnwise")
        data, _, r, c = self._copy(which)
        s = self.scales(which)
        if self.block_dim == 1:
            s_full = s.repeat_interleave(BLOCK, dim=1)[:, :c]
        else:
            s_full = s.repeat_interleave(BLOCK, dim=0)[:r].repeat_interleave(BLOCK, dim=1)[:, :c]
        out = data.float() * s_full
        if which == "columnwise":
            out = out.t()
        return out.to(dtype or self.orig_dtype).contiguous()

    # ---- TE interop --------------------------------------------------------------------------
    def to_te(self) -> dict[str, torch.Tensor | None]:
        """The stored copies under TE's names, data as uint8 (as TE's ``Float8BlockwiseQTensor`` holds it);
        K-major (a preshuffled tensor's copies are unshuffled)."""
        if self.layout != K_MAJOR:
            return self.k_major().to_te()
        u8 = lambda t: None if t is None else t.view(torch.uint8)  # noqa: E731
        return {
            "rowwise_data": u8(self.rowwise_data),
            "rowwise_scale_inv": self.rowwise_scale_inv,
            "columnwise_data": u8(self.columnwise_data),
            "columnwise_scale_inv": self.columnwise_scale_inv,
        }

    @classmethod
    def from_te(
        cls,
        *,
        shape: tuple[int, int],
        block_dim: int,
        fp8_dtype: torch.dtype,
        orig_dtype: torch.dtype = torch.bfloat16,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
    ) -> BlockwiseFp8Tensor:
        """Wrap TE's buffers (data as uint8 or FP8, scales in TE's layout). Shapes are checked."""
        f8 = lambda t: None if t is None else (t.view(fp8_dtype) if t.dtype == torch.uint8 else t)  # noqa: E731
        return cls(
            shape=shape,
            block_dim=block_dim,
            fp8_dtype=fp8_dtype,
            orig_dtype=orig_dtype,
            rowwise_data=f8(rowwise_data),
            rowwise_scale_inv=rowwise_scale_inv,
            columnwise_data=f8(columnwise_data),
            columnwise_scale_inv=columnwise_scale_inv,
        )
