"""Scratch: persistent TMA-ring Gluon act quantizer (experiment, not committed)."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import SIG_TYPE, transpose_tile_layouts
from primus_fp8_plugin.backends.triton.scales import amax_nan, scale_and_inverse, max_nan
from primus_fp8_plugin.backends.triton.launch import FastLauncher
from primus_fp8_plugin.backends.triton.quantize_act import dual_outputs
from primus_fp8_plugin.backends.triton.hopper import num_sms
from primus_fp8_plugin.tensor import BlockwiseFp8Tensor, ceil_div, pad4


@gluon.jit
def act_tma_kernel(
    x_desc, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, M_PAD, K_PAD, fp8_max, amax_eps, in_max,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr,
    L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr, STAGES: gl.constexpr,
):
    B: gl.constexpr = 128
    COMPACT: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    num_m = gl.cdiv(M, B)
    n_tiles = num_m * gl.cdiv(K, B)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, B, B], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    t_s = gl.allocate_shared_memory(col_q_ptr.dtype.element_ty, [B, B], T_SMEM)
    for i in gl.static_range(STAGES):
        t0 = pid + i * nprog
        if t0 < n_tiles:
            mbarrier.expect(ready.index(i), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [(t0 % num_m) * B, (t0 // num_m) * B], ready.index(i), x_bufs.index(i))

    rm = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rk = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    it = 0
    for t in range(pid, n_tiles, nprog):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        x = x_bufs.index(s).load(L).to(gl.float32)
        gl.thread_barrier()  # every thread has read stage s (and the last tile's t_s)
        nt = t + STAGES * nprog
        if nt < n_tiles:
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [(nt % num_m) * B, (nt // num_m) * B], ready.index(s), x_bufs.index(s))
        pid_m = t % num_m
        pid_k = t // num_m
        m0 = pid_m * B
        k0 = pid_k * B
        mask = gl.expand_dims(m0 + rm < M, 1) & gl.expand_dims(k0 + rk < K, 0)
        if ROWWISE:
            scale, s_inv = scale_and_inverse(amax_nan(x, 1), fp8_max, amax_eps, in_max, POW2)
            q = (gl.expand_dims(scale, 1) * x).to(row_q_ptr.dtype.element_ty)
            rq_tile = row_q_ptr + m0.to(gl.int64) * K + k0
            gl.store(rq_tile + gl.expand_dims(rm * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)
            rows = m0 + rm
            gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)
        if COLWISE:
            col_amax = gl.convert_layout(amax_nan(x, 0), COMPACT)
            cscale, cs_inv = scale_and_inverse(col_amax, fp8_max, amax_eps, in_max, POW2)
            cols = k0 + gl.arange(0, B, layout=COMPACT)
            gl.store(col_s_ptr + pid_m * K_PAD + cols, gl.where(cols < K, cs_inv, 1.0), mask=cols < K_PAD)
            cscale_n = gl.convert_layout(cscale, gl.SliceLayout(0, LN))
            xn = gl.convert_layout(x, LN, assert_trivial=True)
            qc = (gl.expand_dims(cscale_n, 0) * xn).to(col_q_ptr.dtype.element_ty)
            t_s.permute((1, 0)).store(qc)
            gl.thread_barrier()
            qt = t_s.load(LT)
            tc = gl.arange(0, B, layout=gl.SliceLayout(1, LT))
            tr = gl.arange(0, B, layout=gl.SliceLayout(0, LT))
            t_mask = gl.expand_dims(k0 + tc < K, 1) & gl.expand_dims(m0 + tr < M, 0)
            t_tile = col_q_ptr + k0.to(gl.int64) * M + m0
            gl.store(t_tile + gl.expand_dims(tc * M, 1) + gl.expand_dims(tr, 0), qt, mask=t_mask)
        it += 1


GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def x_layout(dtype):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(dtype).bits, rank=2)


_launch = FastLauncher(act_tma_kernel)


def quantize_act_tma(x, params, rowwise=True, columnwise=True, stages=2, ctas_per_sm=2, maxnreg=None):
    m, k = x.shape
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    desc = TensorDescriptor.from_tensor(x, [128, 128], x_layout(x.dtype))
    q_any = row_q if row_q is not None else col_q
    s_any = row_s if row_s is not None else col_s
    tiles = ceil_div(m, 128) * ceil_div(k, 128)
    grid = (min(tiles, num_sms(x.device) * ctas_per_sm),)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    _launch(grid, desc, row_q if rowwise else q_any, row_s if rowwise else s_any,
            col_q if columnwise else q_any, col_s if columnwise else s_any, m, k, pad4(m), pad4(k),
            params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max,
            rowwise, columnwise, params.pow2_scales, lay, lay_n, lay_t, t_smem, stages, **opts)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, x.dtype, **parts)


def compile_variant(in_dtype, fp8_dtype, pow2, rowwise, columnwise, stages=2, maxnreg=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    f8 = SIG_TYPE[fp8_dtype]
    desc = TensorDescriptor.from_tensor(torch.empty(1024, 1024, dtype=in_dtype), [128, 128], x_layout(in_dtype))
    sig = {"x_desc": mangle_type(desc), "row_q_ptr": f"*{f8}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{f8}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr",
           "L": "constexpr", "LN": "constexpr", "LT": "constexpr", "T_SMEM": "constexpr", "STAGES": "constexpr"}
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    aligned = ("row_q_ptr", "row_s_ptr", "col_q_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem,
            "STAGES": stages}
    src = GluonASTSource(fn=act_tma_kernel, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": 8}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


if __name__ == "__main__":
    from primus_fp8_plugin.backends.triton.aot import inspect_quantizer
    import re
    for dt in (torch.bfloat16, torch.float32):
        for st in (2, 3):
            for mr in (None,):
                info = inspect_quantizer(compile_variant(dt, torch.float8_e4m3fn, True, True, True, st, mr), torch.float8_e4m3fn)
                sass = info['sass']
                n = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))
                bars = len(re.findall(r"BAR\.SYNC", sass))
                print(f"{str(dt):16} stages={st} maxnreg={mr} regs={info['regs']} spill={info['spill']} smem={info['smem']} undefined={info['undefined'][:3]} instrs={n} bar={bars} ldsv4={info['ld_shared_v4']}")
