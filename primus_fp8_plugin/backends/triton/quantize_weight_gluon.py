"""128x128 weight quantization for Hopper (sm_90), written in Gluon: one read of W [N, K] writes W
(fprop) and W^T (dgrad) with their scales, bit for bit what :func:`.quantize_weight.quantize_128x128`
writes.

Why Gluon: the transposed copy. Plain Triton picks the register layouts itself; its weight kernel
reads the block three times (the amax pass from HBM, one pass per copy from L2) and transposes bf16
through shared memory (80-84% of copy bandwidth on the H200, docs/PERFORMANCE.md). Here the layouts
are explicit, so each thread owns a 4 x 8 sub-tile (4 rows of W): its 4 FP8 values of one column of
W are 4 consecutive bytes of a row of W^T, one 32-bit word. Per program (one 128x128 block, 8 warps):

* load the block once into registers (``L``: 4 x 8 elements per thread, 16-byte loads, each warp
  instruction covering whole 32-byte sectors of 8 rows);
* block amax (NaN-propagating, ``scales.py``), the scale rule of ``scales.py``;
* W: quantize and store from registers (8-byte stores along K);
* W^T: the same FP8 registers stored transposed into shared memory, one 32-bit ``st.shared`` per
  column word; the buffer is swizzled in 32-byte units by the row's 8-row group, so the 32 lanes of
  a store (8 along N x 4 rows of W^T 8 apart) hit 32 distinct banks; after a barrier, read back
  with 16 contiguous bytes of a W^T row per thread (``LT``) and stored with 16-byte stores.

Edges: masked loads (zeros never raise the amax) and masked stores, so any N and K; the wrapper
takes K % 16 == 0 and N % 16 == 0 (the recipe's weight shapes; 16-byte vectors) and leaves other
shapes to the Triton kernel (``GluonWeightUnsupported``)."""

from __future__ import annotations

import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from .hopper import SMEM_LIMIT, runs_on, transpose_tile_layouts
from .launch import FastLauncher
from .scales import max_nan, scale_and_inverse
from .tile_order import tile_coords

NUM_WARPS = 8
MAX_DIM = 2**31 // BLOCK  # in-block offsets are int32, block bases int64


class GluonWeightUnsupported(NotImplementedError):
    """Valid input that this kernel does not take (device or shape); the caller uses the Triton kernel."""


@gluon.jit(do_not_specialize=["group_rows"])
def _quantize_128x128_gluon_kernel(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max, group_rows,
    POW2: gl.constexpr, L: gl.constexpr, LN: gl.constexpr, LT: gl.constexpr, T_SMEM: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):  # fmt: skip
    B: gl.constexpr = 128
    pid_n, pid_k = tile_coords(gl.program_id(0), gl.cdiv(N, B), gl.cdiv(K, B), group_rows)
    n0 = pid_n * B
    k0 = pid_k * B

    # ---- the block, once, in registers: [B (n), B (k)]
    rn = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rk = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(n0 + rn < N, 1) & gl.expand_dims(k0 + rk < K, 0)
    w_blk = w_ptr + n0.to(gl.int64) * stride_wn + k0
    x = gl.load(w_blk + gl.expand_dims(rn * stride_wn, 1) + gl.expand_dims(rk, 0), mask=mask, other=0.0)
    x = x.to(gl.float32)
    amax = gl.reduce(gl.reduce(gl.abs(x), 1, max_nan), 0, max_nan)
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
    q = (scale * x).to(q_ptr.dtype.element_ty)

    # ---- W
    q_blk = q_ptr + n0.to(gl.int64) * K + k0
    gl.store(q_blk + gl.expand_dims(rn * K, 1) + gl.expand_dims(rk, 0), q, mask=mask)

    # ---- W^T: registers -> shared memory (transposed, 32-bit words) -> 16-byte rows
    # The FP8 conversion packs register neighbours in pairs; W^T's 32-bit words need pairs along N,
    # so the transposed copy is converted from LN (same threads, N-first registers; no data moves).
    qn = (scale * gl.convert_layout(x, LN, assert_trivial=True)).to(qt_ptr.dtype.element_ty)
    t_s = gl.allocate_shared_memory(qt_ptr.dtype.element_ty, [B, B], T_SMEM)
    t_s.permute((1, 0)).store(qn)
    gl.thread_barrier()
    qt = t_s.load(LT)  # [B (k), B (n)]
    tk = gl.arange(0, B, layout=gl.SliceLayout(1, LT))
    tn = gl.arange(0, B, layout=gl.SliceLayout(0, LT))
    t_mask = gl.expand_dims(k0 + tk < K, 1) & gl.expand_dims(n0 + tn < N, 0)
    qt_blk = qt_ptr + k0.to(gl.int64) * N + n0
    gl.store(qt_blk + gl.expand_dims(tk * N, 1) + gl.expand_dims(tn, 0), qt, mask=t_mask)

    # scale_inv, and the padding entries of TE's layout (1.0, up to 3 per row) that the last block of
    # each row writes, so that the wrapper launches nothing else
    pads = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
    nk = gl.cdiv(K, B)
    nn = gl.cdiv(N, B)
    gl.store(s_ptr + pid_n * stride_s + pid_k + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_k == nk - 1) & (pid_k + pads < stride_s)))  # fmt: skip
    gl.store(st_ptr + pid_k * stride_st + pid_n + pads, gl.where(pads == 0, s_inv, 1.0),
             mask=(pads == 0) | ((pid_n == nn - 1) & (pid_n + pads < stride_st)))  # fmt: skip


def unsupported_reason(w: torch.Tensor, params: QuantParams) -> str | None:
    """Why this kernel does not take ``w`` (the Triton kernel then does), or None."""
    if not runs_on(w.device):
        return "the Gluon weight quantizer runs on NVIDIA Hopper (sm_90) only"
    if w.dim() != 2 or not w.is_contiguous():
        return "w must be a contiguous 2-D tensor"
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {w.dtype} not supported (bf16, fp16, fp32)"
    n, k = w.shape
    if n % 16 or k % 16:
        return f"w is [{n}, {k}]: N and K must be multiples of 16 (16-byte vectors of both copies)"
    if max(n, k) >= MAX_DIM:
        return f"w is [{n}, {k}]: N and K must stay below {MAX_DIM} (32-bit in-block offsets)"
    if w.data_ptr() % 16:
        return "w must be 16-byte aligned"
    return None


_launch = FastLauncher(_quantize_128x128_gluon_kernel)


def quantize_128x128_gluon(w: torch.Tensor, params: QuantParams) -> BlockwiseFp8Tensor:
    """Same contract and bits as :func:`.quantize_weight.quantize_128x128`: ``w [N, K]`` (bf16, fp16
    or fp32, contiguous) -> W [N, K] and W^T [K, N] in ``params.fp8_dtype`` with 128x128-block
    scale_inv ``[ceil(N/128), pad4(ceil(K/128))]`` and its transpose layout (TE's). Raises
    ``GluonWeightUnsupported`` before launching anything where ``unsupported_reason`` says so."""
    why = unsupported_reason(w, params)
    if why is not None:
        raise GluonWeightUnsupported(why)
    assert params.block_dim == 2
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    qt = torch.empty(k, n, dtype=f8, device=dev)
    # the kernel writes every entry, padding included
    s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    if n and k:
        lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
        _launch(
            (ceil_div(n, BLOCK) * ceil_div(k, BLOCK),), w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
            params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max,
            ceil_div(n, BLOCK),  # group_rows: down each whole column of blocks first (tile_order.py)
            params.pow2_scales, lay, lay_n, lay_t, t_smem, NUM_WARPS,  # POW2, L, LN, LT, T_SMEM, NUM_WARPS
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st
    )


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile check (no GPU needed)
# --------------------------------------------------------------------------------------------------

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
       torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}  # fmt: skip


def aot_variants() -> list[tuple]:
    """Every (input dtype, FP8 dtype, pow2) the wrapper can launch."""
    return [
        (i, f, p)
        for i in (torch.bfloat16, torch.float16, torch.float32)
        for f in (torch.float8_e4m3fn, torch.float8_e5m2)
        for p in (True, False)
    ]


def compile_variant(in_dtype, fp8_dtype, pow2):
    """Compile one variant for sm_90 without a GPU, as a launch with N, K multiples of 16 compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    f8 = _TY[fp8_dtype]
    sig = {"w_ptr": f"*{_TY[in_dtype]}", "q_ptr": f"*{f8}", "qt_ptr": f"*{f8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "group_rows": "i32", "POW2": "constexpr", "L": "constexpr", "LN": "constexpr",
           "LT": "constexpr", "T_SMEM": "constexpr", "NUM_WARPS": "constexpr"}  # fmt: skip
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    aligned = ("w_ptr", "q_ptr", "qt_ptr", "s_ptr", "st_ptr", "N", "K", "stride_wn")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    cons = {"POW2": pow2, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem, "NUM_WARPS": NUM_WARPS}
    src = GluonASTSource(fn=_quantize_128x128_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


_NO_DEST = ("st", "bar", "bra", "ret", "fence", "cp", "red", "prefetch", "exit", "trap")


def undefined_registers(ptx: str) -> set[str]:
    """Registers this kernel's PTX reads but never writes. Triton 3.6 miscompiled the first version
    of this kernel (the FP8 bytes of W^T packed into 32-bit words straight from the converted pairs:
    LLVM left a byte of each word undefined, and the GPU wrote garbage there); this guard catches
    that class of bug ahead of time. A coarse scan (the first operand of an instruction is its
    destination unless the opcode writes nothing), exact for this kernel's PTX, not for every PTX."""
    defs: set[str] = set()
    uses: set[str] = set()
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith((".", "{", "}", "$")) or line.endswith(":"):
            continue
        parts = re.sub(r"^@!?%p\d+\s+", "", line).rstrip(";").split(None, 1)
        if len(parts) < 2:
            continue
        op, args = parts
        if op.split(".")[0] in _NO_DEST:
            uses |= set(re.findall(r"%[a-z]+\d+\b", args))
            continue
        depth, cut = 0, len(args)
        for i, ch in enumerate(args):
            depth += ch in "{[" and 1 or (ch in "}]" and -1) or 0
            if ch == "," and depth == 0:
                cut = i
                break
        defs |= set(re.findall(r"%[a-z]+\d+\b", args[:cut]))
        uses |= set(re.findall(r"%[a-z]+\d+\b", args[cut:]))
    return uses - defs


def inspect_compiled(kernel, fp8_dtype) -> dict:
    """Registers, spills, shared memory and the instructions that matter, from PTX and SASS."""
    from .aot import sm90_resources

    ptx = kernel.asm["ptx"]
    res, sass = sm90_resources(kernel.asm["cubin"])
    cvt = "e4m3x2" if fp8_dtype == torch.float8_e4m3fn else "e5m2x2"
    return {
        "regs": int(res.get("REG", -1)), "spill": int(res.get("STACK", 0)) + int(res.get("LOCAL", 0)),
        "smem": int(getattr(kernel.metadata, "shared", 0)),
        "cvt": len(re.findall(rf"cvt\.rn\.satfinite\.{cvt}\.f32", ptx)),
        "max_nan": len(re.findall(r"max\.NaN\.f32", ptx)),
        # the transpose: 32-bit words into shared memory, 16-byte reads back, no byte-wise traffic
        "st_shared_b32": len(re.findall(r"st\.shared\.(b32|v2\.b16)", ptx)),
        "ld_shared_v4": len(re.findall(r"ld\.shared\.v4\.b32", ptx)),
        "byte_shared": len(re.findall(r"(st|ld)\.shared(\.v[248])?\.[bu]8", ptx)),
        "undefined": sorted(undefined_registers(ptx)),
        "ptx": ptx, "sass": sass,
    }  # fmt: skip


def aot_check(verbose: bool = True) -> bool:
    ok_all = True
    for in_dt, f8, pow2 in aot_variants():
        name = f"{_TY[in_dt]}->{_TY[f8]}:pow2={int(pow2)}"
        try:
            info = inspect_compiled(compile_variant(in_dt, f8, pow2), f8)
        except Exception as e:  # noqa: BLE001
            ok_all = False
            print(f"{name:28} COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]}")
            continue
        ok = (info["spill"] == 0 and info["smem"] <= SMEM_LIMIT and info["cvt"] > 0 and info["max_nan"] > 0
              and info["st_shared_b32"] > 0 and info["ld_shared_v4"] > 0 and info["byte_shared"] == 0
              and not info["undefined"])  # fmt: skip
        ok_all &= ok
        if verbose:
            print(f"{name:28} {'OK ' if ok else 'BAD'} regs={info['regs']} spill={info['spill']} smem={info['smem']} "
                  f"cvt={info['cvt']} st.shared.b32={info['st_shared_b32']} ld.shared.v4={info['ld_shared_v4']} "
                  f"byte_shared={info['byte_shared']} undefined_regs={info['undefined'][:4]}")  # fmt: skip
    return ok_all


if __name__ == "__main__":
    import sys

    sys.exit(0 if aot_check() else 1)
