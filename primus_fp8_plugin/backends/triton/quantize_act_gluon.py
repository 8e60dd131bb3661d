"""Dual 1x128 quantization of activations for Hopper (sm_90), written in Gluon with the thread tiles
it shares with the Gluon weight quantizer (``quantize_gluon_tiles.py``): same contract and bits as
:func:`.quantize_act.quantize_1x128_dual`.

One program per 128x128 tile of X [M, K], 8 warps; the tile is loaded once into registers (layout
``L``: 4 rows x 2 x 8 columns per thread, 8 lanes along K, 4 along M, warps along M):

* rowwise copy [M, K]: an amax per row (in-thread, then 3 shuffles across the 8 K lanes: no shared
  memory), its scale, FP8 stored from registers (8-byte stores); scale_inv ``[kb, m]`` of TE's
  ``[ceil(K/128), pad4(M)]``, padding rows written 1.0;
* columnwise copy X^T [K, M]: an amax per column (in-thread over 4 rows, 2 shuffles, then across the
  8 warps through shared memory), its scale (once per column: one column per thread, back through
  shared memory), the FP8 values converted from the M-first register
  order ``LN`` (no data moves) so that each thread's 4 consecutive rows form one 32-bit word of a
  row of X^T, stored into a swizzled shared buffer (conflict-free), read back 16 bytes per thread
  (``LT``) and stored with 16-byte stores; scale_inv ``[mb, k]`` of ``[ceil(M/128), pad4(K)]``.

Masked loads and stores handle partial tiles; the wrapper takes M % 16 == 0 and K % 16 == 0 (16-byte
rows of both FP8 copies) and raises ``GluonActUnsupported`` otherwise, so that the caller uses the
Triton kernel."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4
from .launch import FastLauncher
from .quantize_act import dual_outputs
from .quantize_gluon_tiles import SIG_TYPE, load_tile, store_transposed, transpose_tile_layouts
from .quantize_gluon_tiles import unsupported_reason as tile_rules
from .scales import amax_nan, scale_and_inverse

NUM_WARPS = 8


class GluonActUnsupported(NotImplementedError):
    """Valid input that this kernel does not take (device or shape); the caller uses the Triton kernel."""


@gluon.jit
def _quantize_1x128_dual_gluon_kernel(
    x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, M_PAD, K_PAD, fp8_max, amax_eps, in_max,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr,
    L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr,
):  # fmt: skip
    B: gl.constexpr = 128
    COMPACT: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = pid_m * B
    k0 = pid_k * B

    x, mask, rm, rk = load_tile(x_ptr, m0, k0, M, K, K, L)

    if ROWWISE:
        scale, s_inv = scale_and_inverse(amax_nan(x, 1), fp8_max, amax_eps, in_max, POW2)
        q = (gl.expand_dims(scale, 1) * x).to(row_q_ptr.dtype.element_ty)
        rq_tile = row_q_ptr + m0.to(gl.int64) * K + k0
        gl.store(rq_tile + gl.expand_dims(rm * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)
        rows = m0 + rm
        gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)

    if COLWISE:
        # The column amax arrives replicated on the 32 threads that hold each column; the scale rule
        # (two IEEE divisions) runs once per column instead, one column per thread (COMPACT), and
        # the scales go back through shared memory.
        col_amax = gl.convert_layout(amax_nan(x, 0), COMPACT)
        cscale, cs_inv = scale_and_inverse(col_amax, fp8_max, amax_eps, in_max, POW2)
        cols = k0 + gl.arange(0, B, layout=COMPACT)
        gl.store(col_s_ptr + pid_m * K_PAD + cols, gl.where(cols < K, cs_inv, 1.0), mask=cols < K_PAD)
        # FP8 pairs along M (LN), so that 4 rows make one 32-bit word of X^T (quantize_weight_gluon.py
        # says why the conversion must not be packed from L)
        cscale_n = gl.convert_layout(cscale, gl.SliceLayout(0, LN))
        xn = gl.convert_layout(x, LN, assert_trivial=True)
        qc = (gl.expand_dims(cscale_n, 0) * xn).to(col_q_ptr.dtype.element_ty)
        store_transposed(qc, col_q_ptr, m0, k0, M, K, LT, T_SMEM)


def unsupported_reason(x: torch.Tensor, params: QuantParams) -> str | None:
    """Why this kernel does not take ``x`` (the Triton kernel then does), or None."""
    if params.block_dim != 1:
        return "1x128 tiles (block_dim=1) only"
    return tile_rules(x, "activation")


_launch = FastLauncher(_quantize_1x128_dual_gluon_kernel)


def quantize_1x128_dual_gluon(x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool) -> BlockwiseFp8Tensor:
    """Same contract and bits as :func:`.quantize_act.quantize_1x128_dual`. Raises
    ``GluonActUnsupported`` before launching anything where ``unsupported_reason`` says so."""
    why = unsupported_reason(x, params)
    if why is not None:
        raise GluonActUnsupported(why)
    m, k = x.shape
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    if m > 0 and k > 0 and (rowwise or columnwise):
        lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
        q_any = row_q if row_q is not None else col_q
        s_any = row_s if row_s is not None else col_s
        _launch(
            (ceil_div(m, BLOCK), ceil_div(k, BLOCK)), x, row_q if rowwise else q_any, row_s if rowwise else s_any,
            col_q if columnwise else q_any, col_s if columnwise else s_any, m, k, pad4(m), pad4(k),
            params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max,
            rowwise, columnwise, params.pow2_scales, lay, lay_n, lay_t, t_smem,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    elif m == 0 and columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, x.dtype, **parts)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile check (no GPU needed)
# --------------------------------------------------------------------------------------------------


def aot_variants() -> list[tuple]:
    """Every (input dtype, FP8 dtype, pow2, rowwise, columnwise) the wrapper can launch."""
    return [
        (i, f, p, r, c)
        for i in (torch.bfloat16, torch.float16, torch.float32)
        for f in (torch.float8_e4m3fn, torch.float8_e5m2)
        for p in (True, False)
        for r, c in ((True, True), (True, False), (False, True))
    ]


def compile_variant(in_dtype, fp8_dtype, pow2, rowwise, columnwise):
    """Compile one variant for sm_90 without a GPU, as a launch with M, K multiples of 16 compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    f8 = SIG_TYPE[fp8_dtype]
    sig = {"x_ptr": f"*{SIG_TYPE[in_dtype]}", "row_q_ptr": f"*{f8}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{f8}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr",
           "L": "constexpr", "LN": "constexpr", "LT": "constexpr", "T_SMEM": "constexpr"}  # fmt: skip
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    aligned = ("x_ptr", "row_q_ptr", "row_s_ptr", "col_q_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem}
    src = GluonASTSource(fn=_quantize_1x128_dual_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


def aot_check(verbose: bool = True) -> bool:
    """Compile and check every variant (``aot.check_quantizer_variants``)."""
    from .aot import check_quantizer_variants

    def name(v):
        return f"{SIG_TYPE[v[0]]}->{SIG_TYPE[v[1]]}:pow2={int(v[2])}:row={int(v[3])}:col={int(v[4])}"

    return check_quantizer_variants(aot_variants(), compile_variant, name, lambda v: v[4], verbose)


if __name__ == "__main__":
    import sys

    sys.exit(0 if aot_check() else 1)
