"""128x128 weight quantization for Hopper (sm_90), written in Gluon: one read of W [N, K] writes W
(fprop) and W^T (dgrad) with their scales, bit for bit what :func:`..triton.quantize_weight.quantize_128x128`
writes.

Why Gluon: the transposed copy. Plain Triton picks the register layouts itself; its weight kernel
reads the block three times (the amax pass from HBM, one pass per copy from L2) and transposes fp32
values through shared memory. Here the layouts
are explicit (``quantize_tiles.py``, shared with the act quantizer), so each thread owns 4 rows
x (2 x 8) columns of the block: its 4 FP8 values of one column of W are 4 consecutive bytes of a row
of W^T, one 32-bit word. Per program (one 128x128 block, 8 warps, 2-D grid, two block barriers):

* load the block once into registers (16-byte loads; a warp instruction covers 4 rows x 128 bytes);
* block amax (NaN-propagating): in-thread, 5 shuffles, each warp's partial into shared memory, one
  barrier, and every thread reduces the 8 partials itself (the compiler's own cross-warp reduction
  takes two barriers); the scale rule of ``scales.py``;
* W: quantize and store from registers (8-byte stores along K);
* W^T: converted again from the N-first register order ``LN`` (FP8 pairs along N, so the 32-bit
  words of W^T need no repacking: Triton 3.6 miscompiles pairs converted along K and repacked, which
  ``tools/aot_triton.py``'s undefined-register check catches), stored transposed into a shared buffer
  in 32-bit words (swizzled: conflict-free), read back and stored with 16-byte stores;
* scale_inv of both copies, including TE's padding entries (so the wrapper launches nothing else).

Edges: masked loads (zeros never raise the amax) and masked stores, so any N and K; the kernel
takes K % 16 == 0 and N % 16 == 0 (the recipe's weight shapes; 16-byte vectors: ``unsupported_reason``);
the heuristics leave other shapes to the Triton kernel, and the wrapper raises ``GluonUnsupported``
for them."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from ..triton.launch import FastLauncher, aligned, int_class
from ..triton.quantize_act import MAX_GRID_Y
from ..triton.scales import max_nan, scale_and_inverse
from .quantize_tiles import load_tile, store_tile, store_transposed, transpose_tile_layouts
from .quantize_tiles import unsupported_reason as tile_rules
from .target import GluonUnsupported

NUM_WARPS = 8


@gluon.jit
def quantize_128x128_gluon_kernel(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: gl.constexpr, ROW_FIRST: gl.constexpr, L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr,
    T_SMEM: gl.constexpr,
):  # fmt: skip
    B: gl.constexpr = 128
    NW: gl.constexpr = gl.num_warps()
    # tile order (grid axis 0 runs fastest): along each row of blocks first for tall weights, down
    # each column first otherwise (about 1.5% apart on the H200 at 16384x4096)
    if ROW_FIRST:
        pid_k = gl.program_id(0)
        pid_n = gl.program_id(1)
        nk = gl.num_programs(0)
        nn = gl.num_programs(1)
    else:
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        nn = gl.num_programs(0)
        nk = gl.num_programs(1)
    n0 = pid_n * B
    k0 = pid_k * B
    t_s = gl.allocate_shared_memory(qt_ptr.dtype.element_ty, [B, B], T_SMEM)

    # ---- the block, once, in registers: [B (n), B (k)]
    x = load_tile(w_ptr, n0, k0, N, K, stride_wn, L).to(gl.float32)
    # warps hold whole rows of [NW, B * B // NW]: one partial amax per warp
    part = gl.reduce(gl.reshape(gl.abs(x), [NW, B * B // NW]), 1, max_nan)
    p_s = gl.allocate_shared_memory(gl.float32, [NW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_s.store(part)
    gl.thread_barrier()
    amax = gl.reduce(p_s.load(gl.BlockedLayout([NW], [32], [NW], [0])), 0, max_nan)  # all partials in every thread
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)

    # ---- W
    store_tile((scale * x).to(q_ptr.dtype.element_ty), q_ptr, n0, k0, N, K, L)

    # ---- W^T. The FP8 conversion packs register neighbours in pairs; W^T's 32-bit words need pairs
    # along N, so the transposed copy is converted from LN (same threads, N-first registers; no data moves).
    qn = (scale * gl.convert_layout(x, LN, assert_trivial=True)).to(qt_ptr.dtype.element_ty)
    store_transposed(qn, t_s, qt_ptr, n0, k0, N, K, LT)

    # scale_inv, and the padding entries of TE's layout (1.0, up to 3 per row) that the last block of
    # each row writes, so that the wrapper launches nothing else
    pads = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    gl.store(s_ptr + pid_n * stride_s + pid_k + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_k == nk - 1) & (pid_k + pads < stride_s)))  # fmt: skip
    gl.store(st_ptr + pid_k * stride_st + pid_n + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_n == nn - 1) & (pid_n + pads < stride_st)))  # fmt: skip


def unsupported_reason(w: torch.Tensor, params: QuantParams) -> str | None:
    """Why this kernel does not take ``w`` (the Triton kernel then does), or None."""
    why = tile_rules(w, "weight")
    if why is None and max(w.shape) > MAX_GRID_Y:
        why = f"the weight is {list(w.shape)}: the larger dim's blocks run on grid axis 1 (at most 65535 programs)"
    return why


_launch = FastLauncher(quantize_128x128_gluon_kernel)


def quantize_128x128_gluon(w: torch.Tensor, params: QuantParams, out: BlockwiseFp8Tensor | None = None) -> BlockwiseFp8Tensor:
    """Same contract and bits as :func:`..triton.quantize_weight.quantize_128x128`: ``w [N, K]`` (bf16, fp16
    or fp32, contiguous) -> W [N, K] and W^T [K, N] in ``params.fp8_dtype`` with 128x128-block
    scale_inv ``[ceil(N/128), pad4(ceil(K/128))]`` and its transpose layout (TE's), into ``out``'s
    four buffers (contiguous, on ``w``'s device: e.g. one expert of a ``GroupedFp8Weight``) when given,
    every entry written. Raises ``GluonUnsupported`` before launching anything where
    ``unsupported_reason`` says so."""
    why = unsupported_reason(w, params)
    if why is not None:
        raise GluonUnsupported(why)
    assert params.block_dim == 2
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    if out is None:
        q = torch.empty(n, k, dtype=f8, device=dev)
        qt = torch.empty(k, n, dtype=f8, device=dev)
        # the kernel writes every entry, padding included
        s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
        st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    else:
        q, s, qt, st = out.rowwise_data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv
        want = ((n, k), scale_inv_shape(n, k, 2), (k, n), scale_inv_shape(k, n, 2))
        for part, shape, dt in zip((q, s, qt, st), want, (f8, torch.float32, f8, torch.float32)):
            if tuple(part.shape) != tuple(shape) or part.dtype != dt or part.device != dev or not part.is_contiguous():
                raise ValueError(f"out holds a {part.dtype} {list(part.shape)} buffer on {part.device} (contiguous: "
                                 f"{part.is_contiguous()}); W [{n}, {k}] needs contiguous {dt} {list(shape)} "
                                 f"on {dev}")  # fmt: skip
    if n and k:
        lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
        row_first = n > k
        nb, kb = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
        pow2 = bool(params.pow2_scales)
        # what can vary between calls, with what specialises the scale strides (pad4(ceil(dim / 128)):
        # divisible by 16 or not) and the outputs' alignment (16 bytes from torch's caching allocator,
        # checked for other allocators); unsupported_reason fixes the rest (16-byte aligned contiguous
        # w, N and K multiples of 16 below MAX_DIM; float scalars)
        hint = (w.dtype, f8, pow2, row_first, int_class(s.stride(0)), int_class(st.stride(0)), aligned(q, qt, s, st))
        _launch.hinted(
            hint, (kb, nb) if row_first else (nb, kb), w, q, qt, s, st, n, k, w.stride(0), s.stride(0),
            st.stride(0), params.fp8_max, float(params.amax_epsilon), torch.finfo(w.dtype).max,
            pow2, row_first, lay, lay_n, lay_t, t_smem,  # POW2, ROW_FIRST, L, LN, LT, T_SMEM
            num_warps=NUM_WARPS,
        )  # fmt: skip
    if out is not None:
        return out
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st
    )
