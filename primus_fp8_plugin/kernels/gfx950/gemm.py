"""Blockwise FP8 GEMM for AMD gfx950 in FlyDSL: ``C [M, N] = A [M, K] @ B [N, K]^T`` with fp32
promotion of every 128-wide K block, on the FP8 MFMA (``v_mfma_f32_16x16x128_f8f6f4``).

A is 1x128-scaled (TE 1D layout, entry [kb, m]); B is 128x128-scaled (TE 2D layout, entry
[n // 128, kb]: fprop, dgrad) or 1x128-scaled (entry [kb, n]: wgrad). 256 threads = 4 waves in a 2x2
tiled MMA of the 16x16x128 atom; block tile 64 x 64 x 128, so each K step is one scale block:
``P = A_kb @ B_kb^T`` in a fresh accumulator, then ``acc += P * (sa * sb)`` in fp32. A's scales
come through a broadcast view partitioned like C (one vector load per K step), B's 128x128 scale
is one scalar load per K step.

Shapes are compiled statically (M, N multiples of 64, K of 128: ``unsupported_reason``); the heuristics
send other shapes to the portable Triton kernel, which also targets gfx950. The launch path has never
run on an MI355X: compile-only (docs/AMD.md). Not a translation of Primus-Turbo's kernels (which need flydsl 0.2.4).
"""

from __future__ import annotations

import functools

import torch

BM, BN, BK = 64, 64, 128
SCALE_BLOCK = 128
THREADS = 256


def build_kernel(m: int, n: int, k: int, *, b_block_dim: int, a_scale_stride: int, b_scale_stride: int, out_bf16: bool):
    """A FlyDSL launcher ``launch(A, B, C, SA, SB)`` for one static problem shape."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    if m % BM or n % BN or k % BK:
        raise ValueError(f"FlyDSL blockwise GEMM needs M % {BM}, N % {BN}, K % {BK} == 0; got {m}, {n}, {k}")
    kblocks = k // SCALE_BLOCK
    f8 = fx.Float8E4M3FN
    out_ty = fx.BFloat16 if out_bf16 else fx.Float32

    @flyc.kernel
    def fp8_blockwise_gemm_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor):
        tid = fx.thread_idx.x
        bid_x, bid_y, _ = fx.block_idx
        A = fx.rocdl.make_buffer_tensor(A)
        B = fx.rocdl.make_buffer_tensor(B)
        C = fx.rocdl.make_buffer_tensor(C)
        SA = fx.rocdl.make_buffer_tensor(SA)
        SB = fx.rocdl.make_buffer_tensor(SB)

        gA = fx.flat_divide(A, (BM, BK))[None, None, bid_x, None]  # (BM, BK, K/BK)
        gB = fx.flat_divide(B, (BN, BK))[None, None, bid_y, None]  # (BN, BK, K/BK)
        gC = fx.flat_divide(C, (BM, BN))[None, None, bid_x, bid_y]  # (BM, BN)

        mma = fx.make_tiled_mma(
            fx.make_mma_atom(fx.rocdl.cdna4.MFMA_Scale(16, 16, 128, f8)), fx.make_layout((2, 2, 1), (1, 2, 0))
        )
        thr = mma.thr_slice(tid)
        load128 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), f8)
        load32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
        store = fx.make_copy_atom(fx.rocdl.BufferCopy16b() if out_bf16 else fx.rocdl.BufferCopy32b(), out_ty)

        frag_a = thr.make_fragment_A(gA[None, None, 0])
        frag_b = thr.make_fragment_B(gB[None, None, 0])
        acc = thr.make_fragment_C(gC)
        partial = thr.make_fragment_C(gC)
        zero = thr.make_fragment_C(gC)
        copy_a = fx.make_tiled_copy_A(load128, mma).get_slice(tid)
        copy_b = fx.make_tiled_copy_B(load128, mma).get_slice(tid)
        src_a, dst_a = copy_a.partition_S(gA), copy_a.retile(frag_a)  # partitions hoisted out of the K loop
        src_b, dst_b = copy_b.partition_S(gB), copy_b.retile(frag_b)

        # A's scale [kb, m] as a (BM, BN, KB) view with N-stride 0: partitioned like C, every
        # accumulator element receives its row's scale.
        copy_c32 = fx.make_tiled_copy_C(load32, mma).get_slice(tid)
        sa_view = fx.make_view(fx.get_iter(SA) + bid_x * BM, fx.make_layout((BM, BN, kblocks), (1, 0, a_scale_stride)))
        src_sa = copy_c32.partition_S(sa_view)
        frag_sa = fx.make_fragment_like(acc)
        dst_sa = copy_c32.retile(frag_sa)
        if fx.const_expr(b_block_dim == 1):  # wgrad: B's scale [kb, n], M-stride 0
            sb_view = fx.make_view(fx.get_iter(SB) + bid_y * BN, fx.make_layout((BM, BN, kblocks), (0, 1, b_scale_stride)))
            src_sb = copy_c32.partition_S(sb_view)
            frag_sb = fx.make_fragment_like(acc)
            dst_sb = copy_c32.retile(frag_sb)
        zero.fill(0)
        acc.fill(0)
        nb = (bid_y * BN) // SCALE_BLOCK

        for kt in range(kblocks):
            fx.copy(load128, src_a[None, None, None, kt], dst_a)
            fx.copy(load128, src_b[None, None, None, kt], dst_b)
            fx.copy(load32, src_sa[None, None, None, kt], dst_sa)
            fx.gemm(mma, partial, frag_a, frag_b, zero)  # this K block's product, fresh accumulator
            if fx.const_expr(b_block_dim == 1):
                fx.copy(load32, src_sb[None, None, None, kt], dst_sb)
                scale = fx.memref_load_vec(frag_sa) * fx.memref_load_vec(frag_sb)
            else:
                sb = fx.rocdl.s_buffer_load(fx.get_iter(SB), nb * b_scale_stride + kt).bitcast(fx.Float32)
                scale = fx.memref_load_vec(frag_sa) * sb
            fx.memref_store_vec(fx.memref_load_vec(acc) + fx.memref_load_vec(partial) * scale, acc)

        copy_out = fx.make_tiled_copy_C(store, mma).get_slice(tid)
        if fx.const_expr(out_bf16):
            out = fx.make_fragment_like(acc, fx.BFloat16)
            out.store(acc.load().to(fx.BFloat16))
            fx.copy(store, copy_out.retile(out), copy_out.partition_S(gC))
        else:
            fx.copy(store, copy_out.retile(acc), copy_out.partition_S(gC))

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor, stream: fx.Stream = fx.Stream(None)):  # noqa: B008
        fp8_blockwise_gemm_kernel(A, B, C, SA, SB).launch(grid=(m // BM, n // BN, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


def unsupported_reason(a, b) -> str | None:
    """Why this kernel does not take ``a [M, K] @ b [N, K]^T``, or None: E4M3 operands, M and N multiples of
    64 (M > 0), K of 128 (the shapes are compiled statically)."""
    m, k = a.shape
    n = b.shape[0]
    if not (a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn):
        return f"E4M3 operands only, got {a.dtype} and {b.dtype}"
    if not (m > 0 and m % BM == 0 and n % BN == 0 and k % BK == 0):
        return f"M % {BM}, N % {BN}, K % {BK} must be 0 (M > 0); got {m}, {n}, {k}"
    return None


@functools.lru_cache(maxsize=64)
def _launcher(m, n, k, b_block_dim, a_stride, b_stride, out_bf16):
    return build_kernel(m, n, k, b_block_dim=b_block_dim, a_scale_stride=a_stride, b_scale_stride=b_stride, out_bf16=out_bf16)


def blockwise_gemm(a, a_scale_inv, b, b_scale_inv, *, b_block_dim, out_dtype, bias=None, accumulate_into=None):
    """The portable ``blockwise_gemm``'s contract (kernels/triton/gemm.py) for the shapes this kernel takes
    (``unsupported_reason``; ValueError otherwise)."""
    import flydsl.compiler as flyc

    why = unsupported_reason(a, b)
    if why is not None:
        raise ValueError(f"the FlyDSL blockwise GEMM does not take this call: {why}")
    m, k = a.shape
    n = b.shape[0]
    direct = bias is None and accumulate_into is None and out_dtype in (torch.bfloat16, torch.float32)
    c = torch.empty(m, n, dtype=out_dtype if direct else torch.float32, device=a.device)
    launch = _launcher(m, n, k, b_block_dim, a_scale_inv.stride(0), b_scale_inv.stride(0), c.dtype == torch.bfloat16)
    t = flyc.from_torch_tensor
    launch(t(a), t(b), t(c), t(a_scale_inv), t(b_scale_inv))
    if direct:
        return c
    if accumulate_into is not None:
        return accumulate_into.add_(c)
    return c.add_(bias.float()).to(out_dtype) if bias is not None else c.to(out_dtype)
