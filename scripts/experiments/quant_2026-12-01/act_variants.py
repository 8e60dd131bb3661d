"""Scratch: variants of the Gluon act quantizer (not committed)."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import SIG_TYPE, store_transposed, transpose_tile_layouts
from primus_fp8_plugin.backends.triton.scales import amax_nan, scale_and_inverse


import triton.language as tl

@triton.jit
def max_nan16(a, b):
    return tl.inline_asm_elementwise("max.NaN.bf16 $0, $1, $2;", "=h,h,h", [a, b], dtype=tl.bfloat16, is_pure=True, pack=1)

@triton.jit
def abs16(a):
    return tl.inline_asm_elementwise("abs.bf16 $0, $1;", "=h,h", [a], dtype=tl.bfloat16, is_pure=True, pack=1)

@triton.jit
def amax16(x, axis: tl.constexpr):
    return tl.reduce(abs16(x), axis, max_nan16)

@gluon.jit
def act_kernel(
    x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, M_PAD, K_PAD, fp8_max, amax_eps, in_max,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr,
    L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr, NATIVE: gl.constexpr,
):
    B: gl.constexpr = 128
    COMPACT: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = pid_m * B
    k0 = pid_k * B
    rm = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rk = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(m0 + rm < M, 1) & gl.expand_dims(k0 + rk < K, 0)
    tile = x_ptr + m0.to(gl.int64) * K + k0
    xr = gl.load(tile + gl.expand_dims(rm * K, 1) + gl.expand_dims(rk, 0), mask=mask, other=0.0)
    if NATIVE:
        x = xr
    else:
        x = xr.to(gl.float32)
    if ROWWISE:
        scale, s_inv = scale_and_inverse((amax16(x, 1) if NATIVE else amax_nan(x, 1)).to(gl.float32), fp8_max, amax_eps, in_max, POW2)
        q = (gl.expand_dims(scale, 1) * x.to(gl.float32)).to(row_q_ptr.dtype.element_ty)
        rq_tile = row_q_ptr + m0.to(gl.int64) * K + k0
        gl.store(rq_tile + gl.expand_dims(rm * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)
        rows = m0 + rm
        gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)
    if COLWISE:
        col_amax = gl.convert_layout((amax16(x, 0) if NATIVE else amax_nan(x, 0)).to(gl.float32), COMPACT)
        cscale, cs_inv = scale_and_inverse(col_amax, fp8_max, amax_eps, in_max, POW2)
        cols = k0 + gl.arange(0, B, layout=COMPACT)
        gl.store(col_s_ptr + pid_m * K_PAD + cols, gl.where(cols < K, cs_inv, 1.0), mask=cols < K_PAD)
        cscale_n = gl.convert_layout(cscale, gl.SliceLayout(0, LN))
        xn = gl.convert_layout(x, LN, assert_trivial=True)
        qc = (gl.expand_dims(cscale_n, 0) * xn.to(gl.float32)).to(col_q_ptr.dtype.element_ty)
        store_transposed(qc, col_q_ptr, m0, k0, M, K, LT, T_SMEM)


def compile_variant(in_dtype, fp8_dtype, pow2, rowwise, columnwise, native, maxnreg=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    f8 = SIG_TYPE[fp8_dtype]
    sig = {"x_ptr": f"*{SIG_TYPE[in_dtype]}", "row_q_ptr": f"*{f8}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{f8}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr",
           "L": "constexpr", "LN": "constexpr", "LT": "constexpr", "T_SMEM": "constexpr", "NATIVE": "constexpr"}
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    aligned = ("x_ptr", "row_q_ptr", "row_s_ptr", "col_q_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem,
            "NATIVE": native}
    src = GluonASTSource(fn=act_kernel, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


if __name__ == "__main__":
    from primus_fp8_plugin.backends.triton.aot import inspect_quantizer
    for dt in (torch.bfloat16,):
        for native in (False, True):
            for mr in (None, 96, 80, 72):
                for rc in ((True, True),):
                    try:
                        info = inspect_quantizer(compile_variant(dt, torch.float8_e4m3fn, True, *rc, native, mr), torch.float8_e4m3fn)
                    except Exception as e:
                        print(dt, native, mr, "FAIL", str(e)[:300]); continue
                    n = len([l for l in info['sass'].splitlines() if l.strip().startswith('/*') and '*/' in l])
                    print(f"{str(dt):16} native={native} maxnreg={mr} regs={info['regs']} spill={info['spill']} maxnan={info['max_nan']} undefined={info['undefined'][:3]} sass_lines={n}")
