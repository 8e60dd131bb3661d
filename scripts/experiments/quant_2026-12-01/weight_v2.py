"""Scratch: weight kernel, 2-D grid, parameterised layouts (4x16 thread tiles as committed, or 8x8)."""
import functools
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import SIG_TYPE, load_tile, transpose_tile_layouts
from primus_fp8_plugin.backends.triton.scales import scale_and_inverse, max_nan
from primus_fp8_plugin.backends.triton.launch import FastLauncher
from primus_fp8_plugin.tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape


@functools.cache
def layouts_8x8():
    # [r, c]: 8 rows x 8 columns per thread; 16 lanes along c (256 contiguous bytes of bf16 per row), 2 along r
    reg_c_first = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    reg_r_first = [[1, 0], [2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
    lanes = [[0, 8], [0, 16], [0, 32], [0, 64], [8, 0]]
    warps = [[16, 0], [32, 0], [64, 0]]
    block = gl.DistributedLinearLayout(reg_c_first, lanes, warps, [], [128, 128])
    block_r_first = gl.DistributedLinearLayout(reg_r_first, lanes, warps, [], [128, 128])
    transposed = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
    t_smem = gl.SwizzledSharedLayout(vec=16, per_phase=8, max_phase=8, order=[1, 0])
    return block, block_r_first, transposed, t_smem


def layouts(kind):
    return transpose_tile_layouts() if kind == "4x16" else layouts_8x8()


@gluon.jit
def weight_kernel2(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: gl.constexpr, L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr, ONEBAR: gl.constexpr,
    GROUP: gl.constexpr = 0,
):
    B: gl.constexpr = 128
    if GROUP == 0:
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        nn = gl.num_programs(0)
        nk = gl.num_programs(1)
    else:
        # GROUP columns of tiles walked together, row by row (GROUP=1: column-first... no: row-first within groups)
        nn = gl.cdiv(N, B)
        nk = gl.cdiv(K, B)
        pid = gl.program_id(0)
        per_group = GROUP * nn
        first_k = (pid // per_group) * GROUP
        size = gl.minimum(nk - first_k, GROUP)
        pid_k = first_k + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    n0 = pid_n * B
    k0 = pid_k * B
    t_s = gl.allocate_shared_memory(qt_ptr.dtype.element_ty, [B, B], T_SMEM)
    x, mask, rn, rk = load_tile(w_ptr, n0, k0, N, K, stride_wn, L)
    x = x.to(gl.float32)
    if ONEBAR:
        # per-warp partial amax, then every thread reduces the 8 partials itself: one block barrier
        NW: gl.constexpr = gl.num_warps()
        part = gl.reduce(gl.reshape(gl.abs(x), [NW, B * B // NW]), 1, max_nan)
        p_s = gl.allocate_shared_memory(gl.float32, [NW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        p_s.store(part)
        gl.thread_barrier()
        amax = gl.reduce(p_s.load(gl.BlockedLayout([NW], [32], [NW], [0])), 0, max_nan)
    else:
        amax = gl.reduce(gl.reshape(gl.abs(x), [B * B]), 0, max_nan)
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
    q = (scale * x).to(q_ptr.dtype.element_ty)
    q_blk = q_ptr + n0.to(gl.int64) * K + k0
    gl.store(q_blk + gl.expand_dims(rn * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)
    qn = (scale * gl.convert_layout(x, LN, assert_trivial=True)).to(qt_ptr.dtype.element_ty)
    t_s.permute((1, 0)).store(qn)
    gl.thread_barrier()
    qt = t_s.load(LT)
    tc = gl.arange(0, B, layout=gl.SliceLayout(1, LT))
    tr = gl.arange(0, B, layout=gl.SliceLayout(0, LT))
    t_mask = gl.expand_dims(k0 + tc < K, 1) & gl.expand_dims(n0 + tr < N, 0)
    t_tile = qt_ptr + k0.to(gl.int64) * N + n0
    gl.store(t_tile + gl.expand_dims(tc * N, 1) + gl.expand_dims(tr, 0), qt, mask=t_mask)
    pads = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    gl.store(s_ptr + pid_n * stride_s + pid_k + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_k == nk - 1) & (pid_k + pads < stride_s)))
    gl.store(st_ptr + pid_k * stride_st + pid_n + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_n == nn - 1) & (pid_n + pads < stride_st)))


_launch = FastLauncher(weight_kernel2)


def quantize_weight_v2(w, params, kind="4x16", onebar=False, group=0, **opts):
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    qt = torch.empty(k, n, dtype=f8, device=dev)
    s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    lay, lay_n, lay_t, t_smem = layouts(kind)
    grid = (ceil_div(n, 128), ceil_div(k, 128)) if group == 0 else (ceil_div(n, 128) * ceil_div(k, 128),)
    _launch(grid, w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
            params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max, params.pow2_scales,
            lay, lay_n, lay_t, t_smem, onebar, group, num_warps=8, **opts)
    return BlockwiseFp8Tensor((n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st)


def compile_variant(in_dtype, fp8_dtype, pow2, kind="4x16", maxnreg=None, onebar=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    f8 = SIG_TYPE[fp8_dtype]
    sig = {"w_ptr": f"*{SIG_TYPE[in_dtype]}", "q_ptr": f"*{f8}", "qt_ptr": f"*{f8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "L": "constexpr", "LN": "constexpr",
           "LT": "constexpr", "T_SMEM": "constexpr", "ONEBAR": "constexpr"}
    lay, lay_n, lay_t, t_smem = layouts(kind)
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("w_ptr", "q_ptr", "qt_ptr", "s_ptr", "st_ptr", "N", "K", "stride_wn")}
    cons = {"POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem, "ONEBAR": onebar}
    src = GluonASTSource(fn=weight_kernel2, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


if __name__ == "__main__":
    import re, collections
    from primus_fp8_plugin.backends.triton.aot import inspect_quantizer
    for kind, ob in (("4x16", False), ("4x16", True), ("8x8", False), ("8x8", True)):
        for dt in (torch.bfloat16, torch.float32):
            info = inspect_quantizer(compile_variant(dt, torch.float8_e4m3fn, True, kind, onebar=ob), torch.float8_e4m3fn)
            sass = info['sass']
            open(f'/tmp/w2_{kind}_{dt}.sass', 'w').write(sass)
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", sass)
            c = collections.Counter(o for o, _ in ops)
            sts = collections.Counter(o + s for o, s in ops if o in ("STS", "LDS", "STG", "LDG"))
            print(f"{kind} onebar={ob} {str(dt):16} regs={info['regs']} spill={info['spill']} smem={info['smem']} undefined={info['undefined'][:3]} instrs={len(ops)} bar={c['BAR']} shfl={c['SHFL']} {dict(sts)}")
