"""Ahead-of-time compilation of every Triton kernel for sm_90 (H100/H200) and gfx950 (MI355X), and of
every variant of the Hopper Gluon kernels for sm_90.

Runs without a GPU: Triton compiles to PTX + cubin (its wheel bundles ptxas and cuobjdump) and to
AMDGCN + hsaco. For each kernel variant that the launchers use, it reports the instructions that
prove the FP8 path was taken and the resources (registers, spills, scratch, shared memory).

    python -m tools.aot_triton [--json FILE] [--dump DIR]                 # the Triton kernels, sm_90 and gfx950
    python -m tools.aot_triton --gluon gemm [--all-configs] [--dump DIR]  # the Hopper Gluon kernels, sm_90
    python -m tools.aot_triton --gluon grouped                           # the Hopper Gluon grouped GEMMs
    python -m tools.aot_triton --gluon quantize_act
    python -m tools.aot_triton --gluon quantize_weight

Must run in a process without ``TRITON_INTERPRET=1`` (interpreted kernels do not compile).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from primus_fp8_plugin.kernels.triton import gemm, quantize_act, quantize_weight, quantize_weight_preshuffle, transpose_weight
from primus_fp8_plugin.kernels.triton import heuristics as portable
from primus_fp8_plugin.kernels.triton.fused_math import OP_SWIGLU
from tools import aot_specs_fused as aot_fused
from tools.aot_specs_grouped import grouped_kernel_specs

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx950": GPUTarget("hip", "gfx950", 64)}
# W^T on demand moves bytes: 128-bit global loads and stores of the byte tiles (not a byte at a time)
TRANSPOSE_EXPECT = {"sm90": [r"ld\.global(\.\w+)*\.v4\.b32", r"st\.global(\.\w+)*\.v4\.b32"],
                    "gfx950": [r"global_load_dwordx4", r"global_store_dwordx4"]}  # fmt: skip


@dataclass
class KernelSpec:
    name: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    # regexes that must occur in the PTX/SASS (sm90) or AMDGCN (gfx950)
    expect: dict[str, list[str]] = field(default_factory=dict)
    # compile with the int arguments specialised as multiples of 16 (aligned shapes) or not (ragged)
    ints_divisible: bool = True
    # or with exactly these int arguments specialised as multiples of 16 (overrides ints_divisible)
    divisible: tuple[str, ...] | None = None
    # further compile options, as the launcher passes them (e.g. enable_fp_fusion)
    options: dict = field(default_factory=dict)


@dataclass
class AotReport:
    kernel: str
    target: str
    registers: int
    spill_bytes: int  # sm90: stack + local bytes; gfx950: private segment (scratch) bytes
    vgpr_spills: int  # gfx950 only (VGPRs spilled to scratch)
    sgpr_spills: int  # gfx950 only (SGPRs spilled to VGPR lanes: no memory traffic)
    shared_bytes: int
    found: dict[str, bool]

    @property
    def ok(self) -> bool:
        return all(self.found.values()) and self.spill_bytes == 0 and self.vgpr_spills == 0


def _quant_act_spec(
    in_ty: str, fp8_ty: str, rowwise: bool, columnwise: bool, sub_m: int | None = None, num_warps: int | None = None,
    ragged: bool = False,
) -> KernelSpec:  # fmt: skip
    """The act quantizer as launched for aligned shapes (M, K multiples of 16) or, with ``ragged``,
    for the others (``heuristics.act_quant_config``), or with another (sub_m, num_warps)."""
    cfg = portable.act_quant_config(17 if ragged else 16, 16)
    sub_m = sub_m or cfg.sub_m
    num_warps = num_warps or cfg.num_warps
    sig = {"x_ptr": f"*{in_ty}", "row_q_ptr": f"*{fp8_ty}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{fp8_ty}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "stride_xm": "i32",
           "fp8_max": "fp32", "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr",
           "COLWISE": "constexpr", "POW2": "constexpr", "BLOCK": "constexpr", "SUB_M": "constexpr"}  # fmt: skip
    cvt = "e4m3x2" if fp8_ty == "fp8e4nv" else "e5m2x2"
    amd = "v_cvt_scalef32_pk_fp8_f32" if fp8_ty == "fp8e4nv" else "v_cvt_scalef32_pk_bf8_f32"
    return KernelSpec(
        f"quantize_1x128_dual[{in_ty}->{fp8_ty},row={int(rowwise)},col={int(columnwise)},sub_m={sub_m}"
        f"{',ragged' if ragged else ''}]",
        quantize_act.quantize_1x128_dual_kernel,
        sig,
        {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": True, "BLOCK": 128, "SUB_M": sub_m},
        num_warps,
        cfg.num_stages,
        # the FP8 conversion, and the NaN-propagating amax (a plain max would hide NaN tiles)
        {"sm90": [rf"cvt\.rn\.satfinite\.{cvt}\.f32", r"max\.NaN\.f32"], "gfx950": [amd, r"v_maximum3?_f32"]},
        ints_divisible=not ragged,
    )


def _quant_weight_spec() -> KernelSpec:
    cfg = portable.weight_quant_config()
    sig = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "BLOCK": "constexpr", "SUB_M": "constexpr"}  # fmt: skip
    return KernelSpec(
        "quantize_128x128[bf16->fp8e4nv]",
        quantize_weight.quantize_128x128_kernel,
        sig,
        {"POW2": True, "BLOCK": 128, "SUB_M": cfg.sub_m},
        cfg.num_warps,
        cfg.num_stages,
        {
            "sm90": [r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"max\.NaN\.f32"],
            "gfx950": ["v_cvt_scalef32_pk_fp8_f32", r"v_maximum3?_f32"],
        },
    )


def _quant_weight_preshuffle_spec() -> KernelSpec:
    cfg = portable.weight_quant_config()
    sig = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
    return KernelSpec(
        "quantize_128x128_preshuffle16[bf16->fp8e4nv]",
        quantize_weight_preshuffle.quantize_128x128_preshuffle_kernel,
        sig,
        {"POW2": True, "BLOCK": 128},
        cfg.num_warps,
        cfg.num_stages,
        {
            "sm90": [r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"max\.NaN\.f32"],
            "gfx950": ["v_cvt_scalef32_pk_fp8_f32", r"v_maximum3?_f32"],
        },
    )


def _transpose_weight_spec() -> KernelSpec:
    """W^T from W's FP8 blocks (bytes moved, nothing converted; ``TRANSPOSE_EXPECT``)."""
    cfg = portable.weight_transpose_config()
    sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "qt_ptr": "*u8", "st_ptr": "*fp32", "N": "i32", "K": "i32",
           "stride_s": "i32", "stride_st": "i32", "stride_se": "i32", "stride_ste": "i32", "BLOCK": "constexpr",
           "SUB_M": "constexpr"}  # fmt: skip
    return KernelSpec(
        "transpose_128x128[u8]",
        transpose_weight.transpose_128x128_kernel,
        sig,
        {"BLOCK": 128, "SUB_M": cfg.sub_m},
        cfg.num_warps,
        cfg.num_stages,
        TRANSPOSE_EXPECT,
    )


def _gemm_spec(direction: str) -> KernelSpec:
    b_2d = direction != "wgrad"
    out_ty = "fp32" if direction == "wgrad" else "bf16"
    cfg = portable.gemm_config()
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": f"*{out_ty}", "a_s_ptr": "*fp32", "b_s_ptr": "*fp32",
           "bias_ptr": f"*{out_ty}", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32",
           "stride_cm": "i32", "stride_as": "i32", "stride_bs": "i32", "B_2D": "constexpr", "HAS_BIAS": "constexpr",
           "ACCUMULATE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "GROUP_M": "constexpr"}  # fmt: skip
    cons = {"B_2D": b_2d, "HAS_BIAS": direction == "fwd", "ACCUMULATE": direction == "wgrad",
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 128, "GROUP_M": cfg.group_m}  # fmt: skip
    return KernelSpec(
        f"blockwise_gemm[{direction}]",
        gemm.blockwise_gemm_kernel,
        sig,
        cons,
        cfg.num_warps,
        cfg.num_stages,
        {
            "sm90": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", r"QGMMA"],
            "gfx950": [r"v_mfma_f32_\w+_f8f6f4"],
        },  # fmt: skip
    )


def kernel_specs() -> list[KernelSpec]:
    return [
        _quant_act_spec("bf16", "fp8e4nv", True, True),
        _quant_act_spec("bf16", "fp8e5", True, True),
        _quant_act_spec("fp32", "fp8e4nv", True, False),
        _quant_act_spec("bf16", "fp8e4nv", True, True, ragged=True),  # M, K not multiples of 16
        _quant_act_spec("fp32", "fp8e4nv", True, True, ragged=True),
        _quant_weight_spec(),
        _quant_weight_preshuffle_spec(),
        _transpose_weight_spec(),
        _gemm_spec("fwd"),
        _gemm_spec("wgrad"),
        *(KernelSpec(**spec) for spec in aot_fused.kernel_specs()),  # norm, SwiGLU, RoPE
        *(KernelSpec(**kw) for kw in grouped_kernel_specs()),  # the grouped (MoE) kernels
    ]


def cuda_tool(name: str) -> str:
    """Path of a CUDA tool (ptxas, cuobjdump) bundled with Triton's wheel."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sm90_resources(cubin: bytes) -> tuple[dict[str, int], str]:
    """Resource usage (``REG``, ``STACK``, ``LOCAL``, ``SHARED``; from ``cuobjdump -res-usage``) and the
    SASS of an sm_90 cubin. Shared by this module and the Gluon kernels' AOT checks."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return {key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage)}, sass


_NO_DEST = ("st", "bar", "bra", "ret", "fence", "cp", "red", "prefetch", "exit", "trap")


def undefined_registers(ptx: str) -> set[str]:
    """Registers a Gluon quantizer's PTX reads but never writes. Triton 3.6 miscompiled the first
    weight quantizer (the FP8 bytes of W^T packed into 32-bit words straight from the converted
    pairs: LLVM left a byte of each word undefined, and the GPU wrote garbage there); this guard
    catches that class of bug ahead of time. A coarse scan (the first operand of an instruction is
    its destination unless the opcode writes nothing), exact for these kernels' PTX, not for every
    PTX (wgmma accumulators, for one, are read and written by their first operand)."""
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


def inspect_quantizer(kernel, fp8_dtype) -> dict:
    """A compiled Gluon quantizer (kernels/sm90/quantize_act.py, quantize_weight.py): registers,
    spills, shared memory and the instructions that matter, from PTX and SASS."""
    ptx = kernel.asm["ptx"]
    res, sass = sm90_resources(kernel.asm["cubin"])
    cvt = "e4m3x2" if fp8_dtype == torch.float8_e4m3fn else "e5m2x2"
    return {
        "regs": int(res.get("REG", -1)), "spill": int(res.get("STACK", 0)) + int(res.get("LOCAL", 0)),
        "smem": int(getattr(kernel.metadata, "shared", 0)),
        "cvt": len(re.findall(rf"cvt\.rn\.satfinite\.{cvt}\.f32", ptx)),
        "max_nan": len(re.findall(r"max\.NaN\.f32", ptx)),
        # the transpose: 4- to 16-byte stores into shared memory, 16-byte reads back, no byte-wise traffic
        "st_shared_wide": len(re.findall(r"st\.shared\.(b32|v2\.b16|v4\.b16|v2\.b32|v4\.b32)", ptx)),
        "ld_shared_v4": len(re.findall(r"ld\.shared\.v4\.b32", ptx)),
        # byte-wise or single 16-bit shared accesses (a transpose done in narrow pieces)
        "byte_shared": len(re.findall(r"(st|ld)\.shared(\.v[248])?\.[bu]8|(st|ld)\.shared\.[bu]16\b", ptx)),
        "undefined": sorted(undefined_registers(ptx)),
        "ptx": ptx, "sass": sass,
    }  # fmt: skip


def check_quantizer_variants(variants, compile_fn, name_fn, transposes_fn, verbose: bool = True) -> bool:
    """Compile each Gluon quantizer variant (``compile_fn(*v)``) for sm_90 and check it: no spills,
    shared memory fits, the saturating FP8 conversion and the NaN-propagating max present, no
    byte-wise or single 16-bit shared-memory traffic, no undefined PTX registers, and where
    ``transposes_fn(v)`` the transposed copy's 16 wide (4- to 16-byte) shared stores per thread and
    16-byte reads. Prints a line per variant."""
    from primus_fp8_plugin.kernels.sm90.target import SMEM_LIMIT

    ok_all = True
    for v in variants:
        name = name_fn(v)
        try:
            info = inspect_quantizer(compile_fn(*v), v[1])
        except Exception as e:  # noqa: BLE001
            ok_all = False
            print(f"{name:40} COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]}")
            continue
        # the transpose: 16 wide stores per thread (4 to 16 bytes each) and 16-byte reads back
        transposed = not transposes_fn(v) or (info["st_shared_wide"] >= 16 and info["ld_shared_v4"] > 0)
        ok = (info["spill"] == 0 and info["smem"] <= SMEM_LIMIT and info["cvt"] > 0 and info["max_nan"] > 0
              and transposed and info["byte_shared"] == 0 and not info["undefined"])  # fmt: skip
        ok_all &= ok
        if verbose:
            print(f"{name:40} {'OK ' if ok else 'BAD'} regs={info['regs']} spill={info['spill']} smem={info['smem']} "
                  f"cvt={info['cvt']} st.shared(wide)={info['st_shared_wide']} ld.shared.v4={info['ld_shared_v4']} "
                  f"byte_shared={info['byte_shared']} undefined_regs={info['undefined'][:4]}")  # fmt: skip
    return ok_all


def compile_spec(spec: KernelSpec, target: str) -> tuple[AotReport, dict[str, str]]:
    # Integer arguments are specialised as multiples of 16, as a launch with aligned shapes would be
    # (ragged specs: not at all, the worst case for registers).
    if spec.divisible is not None:
        divisible_ints = [i for i, name in enumerate(spec.signature) if name in spec.divisible]
    else:
        divisible_ints = [i for i, ty in enumerate(spec.signature.values()) if ty == "i32" and spec.ints_divisible]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible_ints}
    attrs.update({(i,): [["tt.divisibility", 16]] for i, ty in enumerate(spec.signature.values()) if ty[0] == "*"})
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
    k = triton.compile(src, target=TARGETS[target], options=options)
    shared = int(getattr(k.metadata, "shared", 0))
    if target == "sm90":
        res, sass = sm90_resources(k.asm["cubin"])
        text = k.asm["ptx"] + "\n" + sass
        report = AotReport(spec.name, target, res["REG"], res["STACK"] + res["LOCAL"], 0, 0, shared, {})
        asm = {"ptx": k.asm["ptx"], "sass": sass}
    else:
        text = k.asm["amdgcn"]

        def meta(key: str) -> int:
            m = re.search(rf"\.{key}:\s+(\d+)", text)
            return int(m.group(1)) if m else 0

        report = AotReport(
            spec.name, target, meta("vgpr_count"), meta("private_segment_fixed_size"),
            meta("vgpr_spill_count"), meta("sgpr_spill_count"), shared, {},
        )  # fmt: skip
        asm = {"amdgcn": text}
    report.found = {pattern: re.search(pattern, text) is not None for pattern in spec.expect[target]}
    return report, asm


def run_all(dump_dir: Path | None = None) -> list[AotReport]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    reports = []
    for spec in kernel_specs():
        for target in TARGETS:
            report, asm = compile_spec(spec, target)
            reports.append(report)
            if dump_dir:
                dump_asm(dump_dir, f"{spec.name}.{target}", asm)
    return reports


def dump_asm(dump_dir: Path, name: str, asm: dict[str, str]) -> None:
    """Write ``asm`` ({extension: text}, e.g. ptx / sass / amdgcn) as ``dump_dir/<name>.<extension>``."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", name)
    for ext, body in asm.items():
        (dump_dir / f"{stem}.{ext}").write_text(body)


# --------------------------------------------------------------------------------------------------
# The Hopper Gluon kernels (sm_90 only)
# --------------------------------------------------------------------------------------------------

GLUON_KERNELS = ("gemm", "grouped", "quantize_act", "quantize_weight", "fused_act")  # --gluon NAME

# what the Gluon GEMM's PTX / SASS must contain
GEMM_EXPECT_SM90 = {
    "wgmma": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e[45]m[23]\.e[45]m[23]",
    "tma_load": r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global",
    "tma_store": r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta",
    "mbarrier_wait": r"mbarrier\.try_wait",
    "mbarrier_arrive": r"mbarrier\.arrive",
    "setmaxnreg": r"setmaxnreg",
    "QGMMA": r"QGMMA",
}


def sig_type(dtype: torch.dtype) -> str:
    """The name Triton's signatures give ``dtype`` (bf16, fp8e4nv, ...)."""
    from primus_fp8_plugin.kernels.sm90.target import TORCH_TO_GL

    return str(TORCH_TO_GL[dtype])


@dataclass
class GemmVariant:
    """One specialisation of the Gluon GEMM: a launch configuration, the B scale layout, the output."""

    name: str
    b_block_dim: int
    out_dtype: torch.dtype
    has_bias: bool
    accumulate: bool
    a_dtype: torch.dtype = torch.float8_e4m3fn
    b_dtype: torch.dtype = torch.float8_e4m3fn
    config: object = None  # kernels/sm90/gemm.GluonGemmConfig


def gemm_aot_variants(configs: dict | None = None) -> list[GemmVariant]:
    """Every kernel variant the Gluon GEMM's wrapper launches for the given configs ({name: config});
    by default, every variant that ``heuristics.gemm_config`` picks (what the backend runs)."""
    from primus_fp8_plugin.kernels.sm90 import gemm as G
    from primus_fp8_plugin.kernels.sm90 import heuristics as H

    selected_only = configs is None
    configs = configs or {"128x128": H.CONFIG_128x128, "128x256": H.CONFIG_128x256, "256x128": H.CONFIG_256x128}
    out = []
    for cfg_name, cfg in configs.items():
        for bdim in (2, 1):
            if G.supports(cfg, bdim) is not None:
                continue
            for od in (torch.bfloat16, torch.float16, torch.float32):
                if G.supports(cfg, bdim, od) is not None:
                    continue
                for bias in (False, True):
                    out.append(GemmVariant(f"{cfg_name}:b{bdim}d:{sig_type(od)}:bias={int(bias)}", bdim, od, bias, False,
                                           config=cfg))  # fmt: skip
            out.append(GemmVariant(f"{cfg_name}:b{bdim}d:accumulate", bdim, torch.float32, False, True, config=cfg))
            if G.supports(cfg, bdim, torch.float32, True, True) is None:
                out.append(GemmVariant(f"{cfg_name}:b{bdim}d:accumulate+bias", bdim, torch.float32, True, True, config=cfg))
        if G.supports(cfg, 1) is None:
            out.append(GemmVariant(f"{cfg_name}:b1d:e5m2xe4m3:bf16", 1, torch.bfloat16, False, False,
                                   a_dtype=torch.float8_e5m2, config=cfg))  # fmt: skip
            # HYBRID wgrad into Megatron's fp32 main_grad: E5M2 dY with accumulate_into
            out.append(GemmVariant(f"{cfg_name}:b1d:e5m2xe4m3:accumulate", 1, torch.float32, False, True,
                                   a_dtype=torch.float8_e5m2, config=cfg))  # fmt: skip
        if G.supports(cfg, 2) is None:
            out.append(GemmVariant(f"{cfg_name}:b2d:e5m2xe4m3:bf16", 2, torch.bfloat16, False, False,
                                   a_dtype=torch.float8_e5m2, config=cfg))  # fmt: skip
    if selected_only:
        out = [v for v in out if H.gemm_config(v.b_block_dim, v.out_dtype, v.accumulate, v.has_bias) == v.config]
    return out


def compile_gemm(v: GemmVariant):
    """Compile one Gluon GEMM variant for sm_90 without a GPU, as the wrapper's launch compiles it."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from primus_fp8_plugin.kernels.sm90 import gemm as G
    from primus_fp8_plugin.kernels.sm90 import gemm_library as L
    from primus_fp8_plugin.tensor import ceil_div

    cfg = v.config
    bm, bn = cfg.block_m, cfg.block_n
    out_dtype = torch.float32 if v.accumulate else v.out_dtype
    stages = L.stages_that_fit(bm, bn, out_dtype, cfg.num_stages, v.b_block_dim)
    cn = L.c_block_n(bm, bn)
    m = n = k = 1024  # only the descriptors' types matter
    a = torch.empty(m, k, dtype=v.a_dtype)
    b = torch.empty(n, k, dtype=v.b_dtype)
    c = torch.empty(m, n, dtype=out_dtype)
    descs = [
        TensorDescriptor.from_tensor(a, [bm, L.BLOCK_K], L.shared_layout([bm, L.BLOCK_K], a.dtype)),
        TensorDescriptor.from_tensor(b, [bn, L.BLOCK_K], L.shared_layout([bn, L.BLOCK_K], b.dtype)),
        TensorDescriptor.from_tensor(c, [64, cn], L.shared_layout([64, cn], out_dtype)),
    ]
    sig = {
        "a_desc": mangle_type(descs[0]), "b_desc": mangle_type(descs[1]), "c_desc": mangle_type(descs[2]),
        "a_s_ptr": "*fp32", "b_s_ptr": "*fp32", "bias_ptr": f"*{sig_type(out_dtype)}", "c_ptr": f"*{sig_type(out_dtype)}",
        "M": "i32", "N": "i32", "K": "i32", "stride_as": "i32", "stride_bs": "i32", "stride_cm": "i32",
        "as_desc": "constexpr", "bs_desc": "constexpr",
        "B_2D": "constexpr", "HAS_BIAS": "constexpr", "ACCUMULATE": "constexpr",
        "NUM_STAGES": "constexpr", "GROUP_M": "constexpr", "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr",
    }  # fmt: skip
    cons = {"as_desc": None, "bs_desc": None, "B_2D": v.b_block_dim == 2, "HAS_BIAS": v.has_bias,
            "ACCUMULATE": v.accumulate, "NUM_STAGES": stages, "GROUP_M": cfg.group_m,
            "CONSUMER_REGS": cfg.consumer_regs, "PRODUCER_REGS": cfg.producer_regs}  # fmt: skip
    if cfg.scale_tma:
        kbs = ceil_div(k, L.BLOCK_K)
        b_box = list(L.B2D_SCALE_BOX) if v.b_block_dim == 2 else [1, bn]
        for name, rows, box in (("as_desc", kbs, [1, bm]), ("bs_desc", kbs, b_box)):
            sig[name] = mangle_type(L.scale_desc(torch.empty(rows, 1024, dtype=torch.float32), 1024, box))
            del cons[name]
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("a_s_ptr", "b_s_ptr", "bias_ptr", "c_ptr")}
    attrs.update({(names.index(p),): [["tt.divisibility", 16]] for p in ("N", "K", "stride_as", "stride_cm")})
    src = GluonASTSource(fn=G.blockwise_gemm_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=TARGETS["sm90"], options={"num_warps": 4, "maxnreg": L.MAXNREG})


def inspect_gemm(kernel) -> dict:
    """A compiled Gluon GEMM: registers, spills, shared memory, the instructions of
    ``GEMM_EXPECT_SM90`` (counts), the setmaxnreg values and ptxas's warnings."""
    ptx = kernel.asm["ptx"]
    res, sass = sm90_resources(kernel.asm["cubin"])
    with tempfile.TemporaryDirectory() as d:  # ptxas -v again: Triton does not surface its warnings
        ptx_file = Path(d) / "k.ptx"
        ptx_file.write_text(ptx)
        ptxas = subprocess.run([cuda_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx_file), "-o", str(Path(d) / "o.cubin")],
                               capture_output=True, text=True)  # fmt: skip
    text = ptx + "\n" + sass
    found = {key: len(re.findall(pat, text)) for key, pat in GEMM_EXPECT_SM90.items()}
    setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    # C7515: ptxas serialised the wgmma pipeline (accumulator registers touched while in flight)
    warnings = [
        ln
        for ln in (ptxas.stdout + ptxas.stderr).splitlines()
        if "arning" in ln or "Performance Loss" in ln or "spill" in ln and " 0 bytes spill" not in ln
    ]
    return {
        "regs": int(res.get("REG", -1)), "stack": int(res.get("STACK", -1)), "local": int(res.get("LOCAL", -1)),
        "smem": int(getattr(kernel.metadata, "shared", 0)), "found": found, "setmaxnreg": setmaxnreg,
        "ptxas_warnings": warnings, "ptx": ptx, "sass": sass,
    }  # fmt: skip


def check_gemm(dump_dir: Path | None = None, verbose: bool = True, configs: dict | None = None) -> bool:
    """Compile every Gluon GEMM variant the wrapper can launch (``gemm_aot_variants(configs)``) for
    sm_90 and check it: wgmma with FP8 operands, TMA loads/stores, mbarriers, setmaxnreg, no spills,
    fits in shared memory, no serialised wgmma pipeline. Prints a line per variant."""
    from primus_fp8_plugin.kernels.sm90.target import SMEM_LIMIT

    ok_all = True
    for v in gemm_aot_variants(configs):
        try:
            info = inspect_gemm(compile_gemm(v))
        except Exception as e:  # noqa: BLE001
            ok_all = False
            print(f"{v.name:40} COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]}")
            continue
        ok = (all(info["found"].values()) and info["stack"] == 0 and info["local"] == 0
              and info["smem"] <= SMEM_LIMIT and not any("serializ" in w for w in info["ptxas_warnings"]))  # fmt: skip
        ok_all &= ok
        if verbose:
            print(f"{v.name:40} {'OK ' if ok else 'BAD'} regs={info['regs']:3} stack={info['stack']} "
                  f"local={info['local']} smem={info['smem']} setmaxnreg={info['setmaxnreg']} "
                  f"found={info['found']}")  # fmt: skip
            for w in info["ptxas_warnings"]:
                print(f"    ptxas: {w}")
        if dump_dir is not None:
            dump_asm(dump_dir, v.name, {"ptx": info["ptx"], "sass": info["sass"]})
    return ok_all


def grouped_gluon_variants() -> list[tuple]:
    """(name, op, a dtype, out dtype, has_bias, accumulate) of every Gluon grouped GEMM variant the backend
    launches (kernels/sm90/gemm_grouped.py): fwd with and without bias (bf16, fp16), dgrad (E4M3 and HYBRID's E5M2
    dY), wgrad into main_grad (fp32 accumulate, E4M3 / E5M2 dY) and into new bf16 tensors (TMA-stored: the
    outputs in one span of memory, ``gemm_grouped_gluon.output_span``)."""
    e4, e5, bf, f16, f32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32
    return [
        ("grouped_fwd:bf16:bias=1", "fwd", e4, bf, True, False), ("grouped_fwd:bf16:bias=0", "fwd", e4, bf, False, False),
        ("grouped_fwd:fp16:bias=1", "fwd", e4, f16, True, False), ("grouped_dgrad:e5m2:bf16", "fwd", e5, bf, False, False),
        ("grouped_wgrad:main_grad", "wgrad", e4, f32, False, True),
        ("grouped_wgrad:e5m2:main_grad", "wgrad", e5, f32, False, True),
        ("grouped_wgrad:bf16", "wgrad", e4, bf, False, False),
    ]  # fmt: skip


def compile_grouped_gluon(v: tuple, num_groups: int = 128, wgrad_cfg=None, store_tma: bool = True):
    """Compile one Gluon grouped GEMM variant (``grouped_gluon_variants``) for sm_90 without a GPU, with the
    config ``kernels/sm90/heuristics.py`` picks."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from primus_fp8_plugin.kernels.sm90 import gemm_grouped as GG
    from primus_fp8_plugin.kernels.sm90 import gemm_library as L
    from primus_fp8_plugin.kernels.sm90 import heuristics as H
    from primus_fp8_plugin.kernels.sm90 import schedule as S

    _, op, a_dtype, out_dtype, has_bias, accumulate = v
    d = lambda t, box: L.tma_desc(t, list(t.shape), [t.shape[1], 1], box, L.shared_layout(box, t.dtype))  # noqa: E731
    sd = lambda rows, box: L.scale_desc(torch.empty(rows, 1024, dtype=torch.float32), 1024, box)  # noqa: E731
    a = torch.empty(1024, 1024, dtype=a_dtype)
    b = torch.empty(1024, 1024, dtype=torch.float8_e4m3fn)
    if op == "fwd":
        cfg = H.GROUPED_FWD_128x256
        c = torch.empty(1024, 1024, dtype=out_dtype)
        sig = {"a_desc": mangle_type(d(a, [128, 128])), "b_desc": mangle_type(d(b, [256, 128])),
               "c_desc": mangle_type(d(c, [64, 64])), "bs_desc": mangle_type(sd(64, list(L.B2D_SCALE_BOX))),
               "a_s_ptr": "*fp32", "bias_ptr": f"*{sig_type(out_dtype)}", "c_ptr": f"*{sig_type(out_dtype)}",
               "offsets_ptr": "*i32", "padded_ptr": "*i32", "E": "i32", "N": "i32", "K": "i32", "stride_as": "i32",
               "stride_cm": "i32", "stride_biase": "i32", "HAS_BIAS": "constexpr", "NUM_STAGES": "constexpr",
               "GROUP_M": "constexpr", "LOG_E": "constexpr", "CONSUMER_REGS": "constexpr",
               "PRODUCER_REGS": "constexpr"}  # fmt: skip
        cons = {"HAS_BIAS": has_bias, "NUM_STAGES": L.stages_that_fit(128, 256, out_dtype, 0, 2),
                "GROUP_M": cfg.group_m, "LOG_E": S.log2_experts(num_groups), "CONSUMER_REGS": cfg.consumer_regs,
                "PRODUCER_REGS": cfg.producer_regs}  # fmt: skip
        fn, div = GG.grouped_fwd_gluon_kernel, ("a_s_ptr", "bias_ptr", "c_ptr", "N", "K", "stride_as", "stride_cm")
    else:
        cfg = wgrad_cfg or H.grouped_wgrad_config(accumulate)
        bm, bn = cfg.block_m, cfg.block_n
        c = torch.empty(1024, 1024, dtype=out_dtype)
        sig = {"a_desc": mangle_type(d(a, [bm, 128])), "b_desc": mangle_type(d(b, [bn, 128])),
               "as_desc": mangle_type(sd(8, [1, bm])), "bs_desc": mangle_type(sd(8, [1, bn])),
               "c_desc": mangle_type(d(c, [64, 64])),
               "c_table_ptr": "*i64" if accumulate else f"*{sig_type(out_dtype)}", "c0_ptr": f"*{sig_type(out_dtype)}",
               "offsets_ptr": "*i32", "padded_ptr": "*i32", "E": "i32", "M": "i32", "N": "i32", "stride_ce": "i32",
               "span_base": "i64", "row_bytes": "i32", "C_TABLE": "constexpr", "ACCUMULATE": "constexpr",
               "STORE_TMA": "constexpr", "NUM_STAGES": "constexpr", "GROUP_M": "constexpr",
               "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr"}  # fmt: skip
        cons = {"C_TABLE": accumulate, "ACCUMULATE": accumulate, "STORE_TMA": store_tma,
                "NUM_STAGES": L.stages_that_fit(bm, bn, out_dtype, cfg.num_stages, 1, store_tma), "GROUP_M": cfg.group_m,
                "CONSUMER_REGS": cfg.consumer_regs, "PRODUCER_REGS": cfg.producer_regs}  # fmt: skip
        if not store_tma:
            sig["c_desc"] = "constexpr"
            cons["c_desc"] = None
        fn, div = GG.grouped_wgrad_gluon_kernel, ("c0_ptr", "M", "N")
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in div}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=TARGETS["sm90"], options={"num_warps": 4, "maxnreg": L.MAXNREG})


GROUPED_WGRAD_STACK = 16


def spills_in_k_loop(sass: str) -> bool:
    """Whether any local-memory access (STL/LDL) lies inside an innermost loop of the SASS that issues wgmma
    (QGMMA): the K loops (a backward branch's range that holds no other such range)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        targets = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < addr and any(lo <= a <= addr and "QGMMA" in t for a, t in ins
                                                           for lo in (int(targets[-1], 16),)):  # fmt: skip
            loops.append((int(targets[-1], 16), addr))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    local = re.compile(r"(^|\s)(STL|LDL)(\.|\s)")
    return any(lo <= a <= hi and local.search(t) for lo, hi in inner for a, t in ins)


def check_grouped_gluon(dump_dir: Path | None = None, verbose: bool = True) -> bool:
    """Compile every Gluon grouped GEMM variant for sm_90 and check it as ``check_gemm`` checks the dense
    kernel (FP8 wgmma, TMA loads, mbarriers, setmaxnreg, no spills, smem fits, no serialised wgmma);
    TMA stores only where the kernel has them (fwd/dgrad)."""
    from primus_fp8_plugin.kernels.sm90.target import SMEM_LIMIT

    ok_all = True
    for v in grouped_gluon_variants():
        try:
            info = inspect_gemm(compile_grouped_gluon(v))
        except Exception as e:  # noqa: BLE001
            ok_all = False
            print(f"{v[0]:40} COMPILE FAILED: {type(e).__name__}: {str(e)[:3000]}")
            continue
        found = dict(info["found"])
        # wgrad: ptxas keeps one or a few thread-index words (a row offset of the epilogue, formed before the
        # warp specialisation's setmaxnreg) on the stack, reloaded once per tile, outside the K loop: tolerated
        # up to GROUPED_WGRAD_STACK bytes; none in the K loop (the SASS check below)
        stack_ok = info["stack"] == 0 or (v[1] == "wgrad" and info["stack"] <= GROUPED_WGRAD_STACK
                                          and not spills_in_k_loop(info["sass"]))  # fmt: skip
        ok = (all(found.values()) and stack_ok and info["local"] == 0 and info["smem"] <= SMEM_LIMIT
              and not any("serializ" in w for w in info["ptxas_warnings"]))  # fmt: skip
        ok_all &= ok
        if verbose:
            print(f"{v[0]:40} {'OK ' if ok else 'BAD'} regs={info['regs']:3} stack={info['stack']} "
                  f"local={info['local']} smem={info['smem']} setmaxnreg={info['setmaxnreg']} found={found}")  # fmt: skip
            for w in info["ptxas_warnings"]:
                print(f"    ptxas: {w}")
        if dump_dir is not None:
            dump_asm(dump_dir, v[0], {"ptx": info["ptx"], "sass": info["sass"]})
    return ok_all


def act_quant_aot_variants() -> list[tuple]:
    """Every (input dtype, FP8 dtype, pow2, rowwise, columnwise) the Gluon act quantizer launches."""
    return [
        (i, f, p, r, c)
        for i in (torch.bfloat16, torch.float16, torch.float32)
        for f in (torch.float8_e4m3fn, torch.float8_e5m2)
        for p in (True, False)
        for r, c in ((True, True), (True, False), (False, True))
    ]


def compile_act_quant(in_dtype, fp8_dtype, pow2, rowwise, columnwise):
    """Compile one Gluon act-quantizer variant for sm_90 without a GPU, as a launch with M, K multiples
    of 16 compiles."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from primus_fp8_plugin.kernels.sm90 import quantize_act as Q

    f8 = sig_type(fp8_dtype)
    sig = {"x_ptr": f"*{sig_type(in_dtype)}", "row_q_ptr": f"*{f8}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{f8}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr",
           "L": "constexpr", "LN": "constexpr", "LT_RAW": "constexpr", "T_RAW": "constexpr"}  # fmt: skip
    lay, lay_n, lt_raw, t_raw = Q.layouts(torch.finfo(in_dtype).bits // 8)
    names = list(sig)
    divisible_by_16 = ("x_ptr", "row_q_ptr", "row_s_ptr", "col_q_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "L": lay, "LN": lay_n, "LT_RAW": lt_raw, "T_RAW": t_raw}
    src = GluonASTSource(fn=Q.quantize_1x128_dual_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=TARGETS["sm90"], options={"num_warps": Q.NUM_WARPS})


def weight_quant_aot_variants() -> list[tuple]:
    """Every (input dtype, FP8 dtype, pow2, row-first tile order) the Gluon weight quantizer launches."""
    return [
        (i, f, p, r)
        for i in (torch.bfloat16, torch.float16, torch.float32)
        for f in (torch.float8_e4m3fn, torch.float8_e5m2)
        for p in (True, False)
        for r in (False, True)
    ]


def compile_weight_quant(in_dtype, fp8_dtype, pow2, row_first=False):
    """Compile one Gluon weight-quantizer variant for sm_90 without a GPU, as a launch with N, K
    multiples of 16 compiles."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from primus_fp8_plugin.kernels.sm90 import quantize_weight as Q
    from primus_fp8_plugin.kernels.sm90.quantize_tiles import transpose_tile_layouts

    f8 = sig_type(fp8_dtype)
    sig = {"w_ptr": f"*{sig_type(in_dtype)}", "q_ptr": f"*{f8}", "qt_ptr": f"*{f8}", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "ROW_FIRST": "constexpr", "L": "constexpr",
           "LN": "constexpr", "LT": "constexpr", "T_SMEM": "constexpr"}  # fmt: skip
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    names = list(sig)
    divisible_by_16 = ("w_ptr", "q_ptr", "qt_ptr", "s_ptr", "st_ptr", "N", "K", "stride_wn")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
    cons = {"POW2": pow2, "ROW_FIRST": row_first, "L": lay, "LN": lay_n, "LT": lay_t, "T_SMEM": t_smem}
    src = GluonASTSource(fn=Q.quantize_128x128_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=TARGETS["sm90"], options={"num_warps": Q.NUM_WARPS})


def check_act_quant(verbose: bool = True) -> bool:
    """Compile and check every Gluon act-quantizer variant (``check_quantizer_variants``)."""

    def name(v):
        return f"{sig_type(v[0])}->{sig_type(v[1])}:pow2={int(v[2])}:row={int(v[3])}:col={int(v[4])}"

    return check_quantizer_variants(act_quant_aot_variants(), compile_act_quant, name, lambda v: v[4], verbose)


def check_weight_quant(verbose: bool = True) -> bool:
    """Compile and check every Gluon weight-quantizer variant (``check_quantizer_variants``)."""

    def name(v):
        return f"{sig_type(v[0])}->{sig_type(v[1])}:pow2={int(v[2])}:row_first={int(v[3])}"

    return check_quantizer_variants(weight_quant_aot_variants(), compile_weight_quant, name, lambda v: True, verbose)


_FUSED_OPS = {"layernorm": (0, True), "rmsnorm": (1, False), "swiglu": (OP_SWIGLU, False)}


def fused_act_variants() -> list[tuple]:
    """(op, input dtype, FP8 dtype, pow2, rowwise, columnwise) the wrapper launches in training:
    the input role is E4M3; bf16 with and without the columnwise copy, fp16 and fp32 with it."""
    out = []
    for op in _FUSED_OPS:
        for dtype, modes in ((torch.bfloat16, ((True, True), (True, False))), (torch.float16, ((True, True),)),
                             (torch.float32, ((True, True),))):  # fmt: skip
            out += [(op, dtype, torch.float8_e4m3fn, True, r, c) for r, c in modes]
    return out


def fused_act_tunings() -> dict:
    """{name: ``FusedQuantConfig``}: every launch variant of the Gluon fused quantizer."""
    from primus_fp8_plugin.kernels.sm90.heuristics import FUSED_QUANT

    return dict(FUSED_QUANT)


def compile_fused_act_variant(op, in_dtype, fp8_dtype, pow2, rowwise, columnwise, tuning=None):
    """Compile one variant for sm_90 without a GPU, as a launch with M, K, the stride multiples of 16 compiles;
    ``tuning``: a ``FusedQuantConfig`` (default: the heuristics' default variant)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from primus_fp8_plugin.kernels.sm90.fused_act import NUM_WARPS, half_layouts, layouts, quantize_fused_gluon_kernel
    from primus_fp8_plugin.kernels.sm90.heuristics import fused_quant_config
    from primus_fp8_plugin.kernels.triton.fused_math import FP_OPTIONS

    tuning = tuning or fused_quant_config()

    t, f8 = sig_type(in_dtype), sig_type(fp8_dtype)
    sig = {"src_ptr": f"*{t}", "row_q_ptr": f"*{f8}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{f8}", "col_s_ptr": "*fp32",
           "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "gamma_ptr": f"*{t}", "beta_ptr": f"*{t}", "M": "i32", "K": "i32",
           "M_PAD": "i32", "K_PAD": "i32", "stride_sm": "i32", "up_offset": "i32", "fp8_max": "fp32", "amax_eps": "fp32",
           "in_max": "fp32", "OP": "constexpr", "HAS_BETA": "constexpr", "ROWWISE": "constexpr", "COLWISE": "constexpr",
           "POW2": "constexpr", "L": "constexpr", "LN": "constexpr", "LT_RAW": "constexpr", "T_RAW": "constexpr",
           "PARTS": "constexpr", "L2": "constexpr", "LN2": "constexpr"}  # fmt: skip
    lay, lay_n, lt_raw, t_raw = layouts(torch.finfo(in_dtype).bits // 8)
    names = list(sig)
    divisible_by_16 = ("src_ptr", "row_q_ptr", "row_s_ptr", "col_q_ptr", "col_s_ptr", "mean_ptr", "rstd_ptr", "gamma_ptr",
                       "beta_ptr", "M", "K", "M_PAD", "K_PAD", "stride_sm", "up_offset")  # fmt: skip
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
    code, has_beta = _FUSED_OPS[op]
    cons = {"OP": code, "HAS_BETA": has_beta, "ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "L": lay,
            "LN": lay_n, "LT_RAW": lt_raw, "T_RAW": t_raw, "PARTS": tuning.parts, "L2": half_layouts()[0],
            "LN2": half_layouts()[1]}  # fmt: skip
    src = GluonASTSource(fn=quantize_fused_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    options = {"num_warps": NUM_WARPS, **FP_OPTIONS}
    cap = tuning.maxnreg(code == OP_SWIGLU, torch.finfo(in_dtype).bits // 8, rowwise, columnwise)
    if cap is not None:
        options["maxnreg"] = cap
    return triton.compile(src, target=TARGETS["sm90"], options=options)


def check_fused_act_quant(verbose: bool = True) -> bool:
    """Compile and check every variant (``check_quantizer_variants``) of kernels/sm90/fused_act.py, for each of its
    launch variants (``kernels/sm90/heuristics.FUSED_QUANT``), and that no FMA was contracted."""
    tunings = fused_act_tunings()

    def name(v):
        return f"{v[0]}:{sig_type(v[1])}->{sig_type(v[2])}:row={int(v[4])}:col={int(v[5])}:{v[6]}"

    def compile_no_fma(*v):
        kernel = compile_fused_act_variant(*v[:6], tuning=tunings[v[6]])
        if "fma.rn.f32" in kernel.asm["ptx"]:
            raise RuntimeError("the PTX holds fma.rn.f32: an FMA was contracted (compile with enable_fp_fusion=False)")
        return kernel

    # check_quantizer_variants reads v[1] as the FP8 dtype and v[4] as the columnwise flag: pass it views
    # of each variant shaped like the act quantizer's (in dtype, fp8 dtype, pow2, row, col) plus the op and tuning
    variants = [(v[1], v[2], v[3], v[4], v[5], v[0], t) for t in tunings for v in fused_act_variants()]
    return check_quantizer_variants(
        variants,
        lambda i, f, p, r, c, op, t: compile_no_fma(op, i, f, p, r, c, t),
        lambda v: name((v[5], *v[:5], v[6])),
        lambda v: v[4],
        verbose,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AOT-compile the Triton kernels for sm_90 and gfx950 and check them")
    ap.add_argument("--json", type=Path, help="write the reports as JSON")
    ap.add_argument("--dump", type=Path, help="write PTX/SASS/AMDGCN of every kernel into this folder")
    ap.add_argument("--gluon", choices=GLUON_KERNELS,
                    help="check this Hopper Gluon kernel's variants for sm_90 instead (--json does not apply)")  # fmt: skip
    ap.add_argument("--all-configs", action="store_true",
                    help="with --gluon gemm: also compile every entry of tools.gemm_variants.VARIANTS")  # fmt: skip
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    if args.gluon == "gemm":
        configs = None
        if args.all_configs:
            from tools.gemm_variants import VARIANTS as configs
        return 0 if check_gemm(args.dump, configs=configs) else 1
    if args.gluon == "grouped":
        return 0 if check_grouped_gluon(args.dump) else 1
    if args.gluon:
        if args.gluon == "fused_act":
            return 0 if check_fused_act_quant() else 1
        return 0 if {"quantize_act": check_act_quant, "quantize_weight": check_weight_quant}[args.gluon]() else 1
    reports = run_all(args.dump)
    print(f"{'kernel':58} {'target':7} {'regs':>5} {'spill B':>8} {'vgpr sp':>7} {'sgpr sp':>7} {'smem':>7}  instructions")
    for r in reports:
        found = ", ".join(f"{'ok' if v else 'MISSING'} {k}" for k, v in r.found.items())
        print(f"{r.kernel:58} {r.target:7} {r.registers:5} {r.spill_bytes:8} {r.vgpr_spills:7} {r.sgpr_spills:7} "
              f"{r.shared_bytes:7}  {found}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in reports], indent=1))
    bad = [r for r in reports if not r.ok]
    for r in bad:
        print(f"FAILED: {r.kernel} on {r.target}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
