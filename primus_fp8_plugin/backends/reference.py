"""The reference backend: plain torch on any device. It is the spec; slow and plain on purpose.

Quantization follows TE 2.20.2's ``Float8BlockQuantizer`` bit for bit (``docs/NUMERICS.md``):

1. ``amax = max |x|`` over the real elements of the tile, then ``max(amax, amax_epsilon)``;
2. ``scale = fp8_max / amax``, one IEEE round-to-nearest fp32 division;
3. ``scale == inf`` -> ``finfo(input dtype).max``;
4. power-of-2 scales keep only the exponent bits (round down to 2^k);
5. ``amax == 0`` -> ``scale = 1``;
6. ``q = fp8(clamp(fp32(x) * scale, -fp8_max, fp8_max))`` (round to nearest even);
7. ``scale_inv = 1 / scale``.

Plugin rule for non-finite input: a tile holding NaN or +-Inf gets ``scale_inv = NaN`` and NaN
data, so everything computed from it is NaN (nothing is silently clipped to finite values).

GEMMs multiply each 128-wide K block's partial product (computed exactly, in fp64, then rounded
to fp32) by the two operands' scales and add it into an fp32 accumulator ("split accumulator",
DeepSeek-V3 §3.3). TE's Hopper kernels accumulate inside a block with reduced precision, so TE
differs from this by a relative Frobenius error of about 7e-4.
"""

from __future__ import annotations

import torch

from ..recipe import BLOCK, QuantParams
from ..tensor import BlockwiseFp8Tensor, ceil_div, scales_to_te_layout, transpose_blocks
from . import reference_fused as fused
from .base import Availability, Backend
from .grouped_loop import DenseLoopGrouped

_EXPONENT_MASK = 0x7F800000


def scale_from_amax(amax: torch.Tensor, params: QuantParams, input_dtype: torch.dtype) -> torch.Tensor:
    """Steps 1-5: fp32 ``scale`` per tile from its fp32 ``amax`` (non-finite amax not handled here)."""
    amax = torch.clamp_min(amax, params.amax_epsilon)
    # fmax / amax written as a true division: a python scalar over a tensor is computed as
    # reciprocal-then-multiply, which rounds twice.
    scale = torch.full_like(amax, params.fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(input_dtype).max), scale)
    if params.pow2_scales:
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _quantize_tiles(tiles: torch.Tensor, params: QuantParams, input_dtype: torch.dtype, dims: tuple[int, ...]):
    """Quantize ``tiles`` (zero-padded; each tile spans ``dims``) -> (fp8 data, fp32 scale_inv per tile).

    ``amax`` is taken in the input dtype (``abs`` and ``max`` are exact, and NaN or +-Inf anywhere in a
    tile makes its amax non-finite, which marks the tile); ``x * scale`` is computed in fp32.
    """
    amax = tiles.abs().amax(dim=dims, keepdim=True).float()
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, 0.0)
    scale = scale_from_amax(amax, params, input_dtype)
    scaled = torch.mul(tiles, scale) if tiles.dtype == torch.float32 else torch.mul(tiles.float(), scale)
    scaled = scaled.clamp_(-params.fp8_max, params.fp8_max)
    # non-finite tiles -> NaN data and scale; no host branch on the device values (capturable in a CUDA graph)
    scaled = torch.where(finite, scaled, float("nan"))
    scale_inv = torch.where(finite, torch.ones_like(scale) / scale, float("nan"))
    return scaled.to(params.fp8_dtype), scale_inv


def _tiles_of_rows(x: torch.Tensor, cols_padded: int) -> torch.Tensor:
    """``x [R, C]`` as a contiguous ``[R, cols_padded]`` tensor, zero-padded on the right."""
    rows, cols = x.shape
    if cols == cols_padded:
        return x.contiguous()
    padded = torch.zeros(rows, cols_padded, dtype=x.dtype, device=x.device)
    padded[:, :cols] = x
    return padded


def quantize_rows_1x128(x: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim of ``x [R, C]`` -> (data [R, C], scale_inv [R, ceil(C/128)])."""
    rows, cols = x.shape
    cb = ceil_div(cols, BLOCK)
    padded = _tiles_of_rows(x, cb * BLOCK)
    data, scale_inv = _quantize_tiles(padded.view(rows, cb, BLOCK), params, x.dtype, dims=(2,))
    return data.view(rows, cb * BLOCK)[:, :cols].contiguous(), scale_inv.view(rows, cb)


def quantize_blocks_128x128(x: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of ``x [R, C]`` -> (data [R, C], scale_inv [ceil(R/128), ceil(C/128)])."""
    rows, cols = x.shape
    rb, cb = ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)
    padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=x.dtype, device=x.device)
    padded[:rows, :cols] = x
    data, scale_inv = _quantize_tiles(padded.view(rb, BLOCK, cb, BLOCK), params, x.dtype, dims=(1, 3))
    return data.view(rb * BLOCK, cb * BLOCK)[:rows, :cols].contiguous(), scale_inv.view(rb, cb)


def blockwise_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` with per-128-K-block scale promotion into an fp32 accumulator.

    ``a_scale``: [M, ceil(K/128)] (1x128 tiles). ``b_scale``: [N, ceil(K/128)] if ``b_block_dim``
    is 1, [ceil(N/128), ceil(K/128)] if 2. Bias (added in fp32) and accumulation are optional.

    Each K block's sum of products is computed in fp64, where it is exact for E4M3 x E4M3 (products
    are multiples of 2^-18 below 2^17.6, so a 128-term sum needs at most 43 bits); with E5M2
    gradients (HYBRID) a block whose sum spans more than fp64's 53 bits is rounded in the matmul's
    order. The block sum is then rounded to fp32 and multiplied by the two scales in fp32, blocks
    are added in K order. The cost is the fp64 matmul (on a CPU about half the fp32 rate).
    """
    m, k = a.shape
    n = b.shape[0]
    if b_block_dim == 2:
        b_scale = b_scale.repeat_interleave(BLOCK, dim=0)[:n]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(ceil_div(k, BLOCK)):
        ks = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        partial = (a[:, ks].double() @ b[:, ks].double().t()).float()
        acc += partial * a_scale[:, kb : kb + 1] * b_scale[:, kb].unsqueeze(0)
    if bias is not None:
        acc += bias.float()
    if accumulate_into is not None:
        accumulate_into += acc
        return accumulate_into
    return acc.to(out_dtype)


class ReferenceBackend(DenseLoopGrouped, Backend):
    """Plain torch, any device; the oracle every other backend is tested against. Its grouped (MoE)
    operations loop the dense ones over the experts (``grouped_loop.py``)."""

    name = "reference"

    def availability(self, device: torch.device) -> Availability:
        return Availability(True)

    def quantize_act(self, x, params, *, rowwise, columnwise):
        rows, cols = x.shape
        parts = {}
        if rowwise:
            data, s = quantize_rows_1x128(x, params)
            parts.update(rowwise_data=data, rowwise_scale_inv=scales_to_te_layout(s, rows, cols, 1))
        if columnwise:
            data, s = quantize_rows_1x128(x.t(), params)
            parts.update(columnwise_data=data, columnwise_scale_inv=scales_to_te_layout(s, cols, rows, 1))
        return BlockwiseFp8Tensor((rows, cols), 1, params.fp8_dtype, x.dtype, **parts)

    def quantize_weight(self, w, params):
        rows, cols = w.shape
        data, s = quantize_blocks_128x128(w, params)
        scale = scales_to_te_layout(s, rows, cols, 2)
        col_data, col_scale = transpose_blocks(data, scale)  # for 128x128 blocks W^T is the exact transpose
        return BlockwiseFp8Tensor((rows, cols), 2, params.fp8_dtype, w.dtype, rowwise_data=data, rowwise_scale_inv=scale,
                                  columnwise_data=col_data, columnwise_scale_inv=col_scale)  # fmt: skip

    def gemm_fwd(self, x, w, bias, out_dtype):
        return blockwise_gemm(x.rowwise_data, x.scales("rowwise"), w.rowwise_data, w.scales("rowwise"), 2, out_dtype, bias)

    def gemm_dgrad(self, dy, w, out_dtype):
        return blockwise_gemm(dy.rowwise_data, dy.scales("rowwise"), w.columnwise_data, w.scales("columnwise"), 2, out_dtype)

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        return blockwise_gemm(
            dy.columnwise_data,
            dy.scales("columnwise"),
            x.columnwise_data,
            x.scales("columnwise"),
            1,
            out_dtype,
            accumulate_into=accumulate_into,
        )

    # fused ops: the torch composition is the spec (reference_fused.py)
    def norm_fwd(self, x, gamma, beta, eps, normalization):
        return fused.norm_fwd(x, gamma, beta, eps, normalization)

    def quantize_norm_act(self, x, gamma, beta, eps, normalization, params, *, rowwise, columnwise):
        y, mean, rstd = fused.norm_fwd(x, gamma, beta, eps, normalization)
        return self.quantize_act(y, params, rowwise=rowwise, columnwise=columnwise), mean, rstd

    def norm_bwd(self, dy, x, gamma, mean, rstd, *, need_dgamma, need_dbeta):
        return fused.norm_bwd(dy, x, gamma, mean, rstd, need_dgamma=need_dgamma, need_dbeta=need_dbeta)

    def swiglu_fwd(self, h):
        return fused.swiglu_fwd(h)

    def quantize_swiglu_act(self, h, params, *, rowwise, columnwise):
        return self.quantize_act(fused.swiglu_fwd(h), params, rowwise=rowwise, columnwise=columnwise)

    def swiglu_bwd(self, dy, h):
        return fused.swiglu_bwd(dy, h)

    def rope(self, t, cos, sin, *, interleaved, backward):
        return fused.rope(t, cos, sin, interleaved=interleaved, backward=backward)

    def unpermute(self, y, sorted_indices, token_rows, token_offsets, probs):
        return fused.unpermute(y, sorted_indices, token_offsets.numel() - 1, probs)
