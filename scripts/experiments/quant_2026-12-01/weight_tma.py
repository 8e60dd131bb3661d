"""Scratch: persistent TMA-ring Gluon weight quantizer (experiment, not committed)."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import SIG_TYPE, transpose_tile_layouts
from primus_fp8_plugin.backends.triton.scales import scale_and_inverse, max_nan
from primus_fp8_plugin.backends.triton.launch import FastLauncher
from primus_fp8_plugin.backends.triton.hopper import num_sms
from primus_fp8_plugin.tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape


@gluon.jit
def weight_tma_kernel(
    w_desc, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: gl.constexpr, L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr, STAGES: gl.constexpr,
):
    B: gl.constexpr = 128
    nn = gl.cdiv(N, B)
    nk = gl.cdiv(K, B)
    n_tiles = nn * nk
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    x_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, B, B], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    t_s = gl.allocate_shared_memory(qt_ptr.dtype.element_ty, [B, B], T_SMEM)
    for i in gl.static_range(STAGES):
        t0 = pid + i * nprog
        if t0 < n_tiles:
            mbarrier.expect(ready.index(i), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [(t0 % nn) * B, (t0 // nn) * B], ready.index(i), x_bufs.index(i))
    rn = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rk = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    pads = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    it = 0
    for t in range(pid, n_tiles, nprog):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        x = x_bufs.index(s).load(L).to(gl.float32)
        gl.thread_barrier()
        nt = t + STAGES * nprog
        if nt < n_tiles:
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [(nt % nn) * B, (nt // nn) * B], ready.index(s), x_bufs.index(s))
        pid_n = t % nn
        pid_k = t // nn
        n0 = pid_n * B
        k0 = pid_k * B
        mask = gl.expand_dims(n0 + rn < N, 1) & gl.expand_dims(k0 + rk < K, 0)
        amax = gl.reduce(gl.reduce(gl.abs(x), 1, max_nan), 0, max_nan)
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
        gl.store(s_ptr + pid_n * stride_s + pid_k + pads, gl.where(pads == 0, s_inv, 1.0),
                 mask=(pads == 0) | ((pid_k == nk - 1) & (pid_k + pads < stride_s)))
        gl.store(st_ptr + pid_k * stride_st + pid_n + pads, gl.where(pads == 0, s_inv, 1.0),
                 mask=(pads == 0) | ((pid_n == nn - 1) & (pid_n + pads < stride_st)))
        it += 1


def x_layout(dtype):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(dtype).bits, rank=2)


_launch = FastLauncher(weight_tma_kernel)


def quantize_weight_tma(w, params, stages=2, ctas_per_sm=2, maxnreg=None):
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    qt = torch.empty(k, n, dtype=f8, device=dev)
    s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    desc = TensorDescriptor.from_tensor(w, [128, 128], x_layout(w.dtype))
    tiles = ceil_div(n, 128) * ceil_div(k, 128)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    _launch((min(tiles, num_sms(dev) * ctas_per_sm),), desc, q, qt, s, st, n, k, s.stride(0), st.stride(0),
            params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max, params.pow2_scales,
            lay, lay_n, lay_t, t_smem, stages, **opts)
    return BlockwiseFp8Tensor((n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st)


def compile_variant(in_dtype, fp8_dtype, pow2, stages=2, maxnreg=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    f8 = SIG_TYPE[fp8_dtype]
    desc = TensorDescriptor.from_tensor(torch.empty(1024, 1024, dtype=in_dtype), [128, 128], x_layout(in_dtype))
    sig = {"w_desc": mangle_type(desc), "q_ptr": f"*{f8}", "qt_ptr": f"*{f8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "L": "constexpr", "LN": "constexpr",
           "LT": "constexpr", "T_SMEM": "constexpr", "STAGES": "constexpr"}
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("q_ptr", "qt_ptr", "s_ptr", "st_ptr", "N", "K")}
    cons = {"POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem, "STAGES": stages}
    src = GluonASTSource(fn=weight_tma_kernel, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


if __name__ == "__main__":
    from primus_fp8_plugin.backends.triton.aot import inspect_quantizer
    import re
    for dt in (torch.bfloat16,):
        for st, mr in ((2, None), (2, 128), (2, 80), (3, None)):
            info = inspect_quantizer(compile_variant(dt, torch.float8_e4m3fn, True, st, mr), torch.float8_e4m3fn)
            sass = info['sass']
            n = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))
            print(f"{str(dt):16} stages={st} maxnreg={mr} regs={info['regs']} spill={info['spill']} smem={info['smem']} undefined={info['undefined'][:3]} instrs={n} bar={len(re.findall('BAR.SYNC', sass))}")
