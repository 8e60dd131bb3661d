"""Scratch: weight kernel v3: raw tile transposed into shared memory and per-warp partial amax, one barrier."""
import sys, os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import SIG_TYPE
from primus_fp8_plugin.backends.triton.scales import scale_and_inverse, max_nan
from primus_fp8_plugin.backends.triton.launch import FastLauncher
from primus_fp8_plugin.tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from act_v3 import v3_layouts


@gluon.jit
def weight_kernel3(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: gl.constexpr, L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_RAW: gl.constexpr,
):
    B: gl.constexpr = 128
    NW: gl.constexpr = gl.num_warps()
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * B
    k0 = pid_k * B
    rn = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rk = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(n0 + rn < N, 1) & gl.expand_dims(k0 + rk < K, 0)
    xr = gl.load(w_ptr + n0.to(gl.int64) * stride_wn + k0 + gl.expand_dims(rn * stride_wn, 1) + gl.expand_dims(rk, 0),
                 mask=mask, other=0.0)
    t_raw = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [B, B], T_RAW)
    t_raw.permute((1, 0)).store(gl.convert_layout(xr, LN, assert_trivial=True))
    x = xr.to(gl.float32)
    part = gl.reduce(gl.reshape(gl.abs(x), [NW, B * B // NW]), 1, max_nan)
    p_s = gl.allocate_shared_memory(gl.float32, [NW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_s.store(part)
    gl.thread_barrier()
    amax = gl.reduce(p_s.load(gl.BlockedLayout([NW], [32], [NW], [0])), 0, max_nan)
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
    q = (scale * x).to(q_ptr.dtype.element_ty)
    gl.store(q_ptr + n0.to(gl.int64) * K + k0 + gl.expand_dims(rn * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)
    qt = (scale * t_raw.load(LT).to(gl.float32)).to(qt_ptr.dtype.element_ty)
    tc = gl.arange(0, B, layout=gl.SliceLayout(1, LT))
    tr = gl.arange(0, B, layout=gl.SliceLayout(0, LT))
    t_mask = gl.expand_dims(k0 + tc < K, 1) & gl.expand_dims(n0 + tr < N, 0)
    gl.store(qt_ptr + k0.to(gl.int64) * N + n0 + gl.expand_dims(tc * N, 1) + gl.expand_dims(tr, 0), qt, mask=t_mask)
    pads = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    nk = gl.num_programs(1)
    nn = gl.num_programs(0)
    gl.store(s_ptr + pid_n * stride_s + pid_k + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_k == nk - 1) & (pid_k + pads < stride_s)))
    gl.store(st_ptr + pid_k * stride_st + pid_n + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_n == nn - 1) & (pid_n + pads < stride_st)))
    p_s._keep_alive()


_launch = FastLauncher(weight_kernel3)


def quantize_weight_v3(w, params, **opts):
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    qt = torch.empty(k, n, dtype=f8, device=dev)
    s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    lay, lay_n, lt, t_raw = v3_layouts(w.element_size())
    _launch((ceil_div(n, 128), ceil_div(k, 128)), w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
            params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max, params.pow2_scales,
            lay, lay_n, lt, t_raw, num_warps=8, **opts)
    return BlockwiseFp8Tensor((n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st)


def compile_variant(in_dtype, fp8_dtype, pow2, maxnreg=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    f8 = SIG_TYPE[fp8_dtype]
    sig = {"w_ptr": f"*{SIG_TYPE[in_dtype]}", "q_ptr": f"*{f8}", "qt_ptr": f"*{f8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "L": "constexpr", "LN": "constexpr",
           "LT": "constexpr", "T_RAW": "constexpr"}
    lay, lay_n, lt, t_raw = v3_layouts(torch.finfo(in_dtype).bits // 8)
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("w_ptr", "q_ptr", "qt_ptr", "s_ptr", "st_ptr", "N", "K", "stride_wn")}
    cons = {"POW2": pow2, "L": lay, "LN": lay_n, "LT": lt, "T_RAW": t_raw}
    src = GluonASTSource(fn=weight_kernel3, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


if __name__ == "__main__":
    import re, collections
    from primus_fp8_plugin.backends.triton.aot import inspect_quantizer
    for dt in (torch.bfloat16, torch.float32):
        info = inspect_quantizer(compile_variant(dt, torch.float8_e4m3fn, True), torch.float8_e4m3fn)
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", info['sass'])
        c = collections.Counter(o for o, _ in ops)
        mem = collections.Counter(o + s for o, s in ops if o in ("STS", "LDS", "STG", "LDG"))
        print(f"{str(dt):16} regs={info['regs']} spill={info['spill']} smem={info['smem']} undefined={info['undefined'][:3]} instrs={len(ops)} bar={c['BAR']} shfl={c['SHFL']} {dict(mem)}")
