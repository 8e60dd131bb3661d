"""128x128 weight quantization into FlyDSL's (16, 16) preshuffled layout (``preshuffle.py``): one
HBM read of W [N, K] writes W (fprop) and W^T (dgrad), both preshuffled, with TE-layout scales.

A program owns one 128x128 block: it loads the block once, takes its amax, quantizes it and stores
each FP8 byte twice, at its preshuffled offset in W and in W^T
(no register transpose: W^T's offsets are computed from the same (n, k) coordinates). The scales
are those of ``quantize_weight.py`` (TE's 2D layouts, W^T's the transpose), the FP8 values bit for
bit those of the K-major kernel and of the reference backend.

W^T's copy for K % 256 == 128 lives in a storage padded to K + 128 rows (zero bytes, scale rows of
1.0; ``preshuffle.padded_rows``, ``dgrad_padded_rows``) so that dgrad can run 256-wide output tiles
over it; the tensors themselves keep their shapes.

Shapes: ``N % 32 == 0`` and ``K % 32 == 0`` (both copies must fit the layout; blocks at the edge of a
dim that is not a multiple of 128 are masked). Others raise ValueError: use the K-major quantizer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...preshuffle import PRESHUFFLE16, check_preshuffle_shape, dgrad_padded_rows
from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from .heuristics import QuantizeConfig, weight_quant_config
from .launch import FastLauncher
from .quantize_act import MAX_GRID_Y
from .quantize_weight import MAX_DIM
from .scales import max_nan, scale_and_inverse


@triton.jit
def quantize_128x128_preshuffle_kernel(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK
    k0 = pid_k * BLOCK
    r = tl.arange(0, BLOCK)  # n within the block
    c = tl.arange(0, BLOCK)  # k within the block
    full = (n0 + BLOCK <= N) & (k0 + BLOCK <= K)
    mask = (n0 + r < N)[:, None] & (k0 + c < K)[None, :]
    w_blk = w_ptr + n0.to(tl.int64) * stride_wn + k0
    # preshuffled byte of (n, k) in W [N, K]:   ((n//16)*(K/16) + k//16)*256 + (n%16)*16 + k%16
    # and in W^T [K, N]:                         ((k//16)*(N/16) + n//16)*256 + (k%16)*16 + n%16
    # n0, k0 are multiples of 128, so each splits into a 64-bit block base and a 32-bit in-block part
    q_blk = q_ptr + n0.to(tl.int64) * K + k0.to(tl.int64) * 16
    qt_blk = qt_ptr + k0.to(tl.int64) * N + n0.to(tl.int64) * 16
    off_q = (r // 16)[:, None] * (16 * K) + (c // 16)[None, :] * 256 + (r % 16)[:, None] * 16 + (c % 16)[None, :]
    off_qt = (c // 16)[None, :] * (16 * N) + (r // 16)[:, None] * 256 + (c % 16)[None, :] * 16 + (r % 16)[:, None]
    if full:
        x = tl.load(w_blk + r[:, None] * stride_wn + c[None, :])
    else:
        x = tl.load(w_blk + r[:, None] * stride_wn + c[None, :], mask=mask, other=0.0)
    amax = tl.reduce(tl.reduce(tl.abs(x.to(tl.float32)), 1, max_nan), 0, max_nan)  # NaN-propagating
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
    q = (scale * x.to(tl.float32)).to(q_ptr.dtype.element_ty)
    if full:
        tl.store(q_blk + off_q, q)
        tl.store(qt_blk + off_qt, q)
    else:
        tl.store(q_blk + off_q, q, mask=mask)
        tl.store(qt_blk + off_qt, q, mask=mask)
    tl.store(s_ptr + pid_n * stride_s + pid_k, s_inv)
    tl.store(st_ptr + pid_k * stride_st + pid_n, s_inv)


_launch = FastLauncher(quantize_128x128_preshuffle_kernel)


def quantize_128x128_preshuffled(
    w: torch.Tensor, params: QuantParams, *, config: QuantizeConfig | None = None
) -> BlockwiseFp8Tensor:
    """Both copies of a contiguous ``w [N, K]`` quantized with 128x128 blocks, preshuffled, in one pass.

    Returns a ``BlockwiseFp8Tensor`` with ``layout="preshuffle16"``: ``rowwise_data`` [N, K] and
    ``columnwise_data`` [K, N] in the (16, 16) byte order, scales in TE's layouts. For K % 256 == 128,
    W^T's data and scales sit at the start of storages padded to K + 128 rows (zero bytes; scale rows
    of 1.0): ``preshuffle.padded_rows(t, K + 128)`` sees them padded."""
    assert w.dim() == 2 and w.is_contiguous() and params.block_dim == 2
    cfg = config or weight_quant_config()
    if cfg.sub_m != BLOCK:
        raise ValueError(f"the preshuffle quantizer takes each 128x128 block in one pass (sub_m=128), got {cfg}")
    n, k = w.shape
    check_preshuffle_shape(n, k, "weight W")
    check_preshuffle_shape(k, n, "weight W^T")
    if max(n, k) >= MAX_DIM:
        raise ValueError(f"weight is [{n}, {k}]: in-block offsets are 32-bit, so N and K must stay below {MAX_DIM}")
    if k > MAX_GRID_Y:
        raise ValueError(f"weight is [{n}, {k}]: K's {ceil_div(k, BLOCK)} blocks exceed the 65535 programs of a "
                         f"grid's second axis (K <= {MAX_GRID_Y})")  # fmt: skip
    if w.dtype == torch.float32 and w.is_cuda:
        # on an H200 the W^T copy of an fp32 block holding NaN came out finite where the reference is NaN
        # (bf16 bit-exact; the CPU interpreter bit-exact for both): refuse rather than risk silent garbage
        raise NotImplementedError(
            "quantize_128x128_preshuffled: fp32 weights on a GPU are not verified bit-exact (the W^T copy of a block "
            "with NaN differed on an H200); pass bf16 weights, or use the K-major quantizer (quantize_weight.py)"
        )
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    kp = dgrad_padded_rows(k) if k % BLOCK == 0 else k  # W^T's storage rows (the tail: zero rows)
    qt_store = torch.empty(kp * n, dtype=torch.uint8, device=dev)
    if kp != k:
        qt_store[k * n :].zero_()
    qt = qt_store[: k * n].view(f8).view(k, n)
    s = torch.ones(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.ones(scale_inv_shape(kp, n, 2), dtype=torch.float32, device=dev)[: ceil_div(k, BLOCK)]
    grid = (ceil_div(n, BLOCK), ceil_div(k, BLOCK))
    _launch(
        grid, w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
        params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max,
        params.pow2_scales, BLOCK,  # POW2, BLOCK
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st,
        layout=PRESHUFFLE16,
    )  # fmt: skip
