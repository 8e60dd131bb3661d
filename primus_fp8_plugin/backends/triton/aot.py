"""Ahead-of-time compilation of every Triton kernel for sm_90 (H100/H200) and gfx950 (MI355X).

Runs without a GPU: Triton compiles to PTX + cubin (its wheel bundles ptxas and cuobjdump) and to
AMDGCN + hsaco. For each kernel variant that the launchers use, it reports the instructions that
prove the FP8 path was taken and the resources (registers, spills, scratch, shared memory).

    python -m primus_fp8_plugin.backends.triton.aot [--json FILE]

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

from . import gemm, quantize_act, quantize_weight
from .aot_specs_grouped import grouped_kernel_specs

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx950": GPUTarget("hip", "gfx950", 64)}


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
    for the others (``quantize_act.launch_config``), or with another (sub_m, num_warps)."""
    default_sub_m, default_warps = quantize_act.launch_config(17 if ragged else 16, 16)
    sub_m = sub_m or default_sub_m
    num_warps = num_warps or default_warps
    sig = {"x_ptr": f"*{in_ty}", "row_q_ptr": f"*{fp8_ty}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{fp8_ty}",
           "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32", "stride_xm": "i32",
           "fp8_max": "fp32", "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr",
           "COLWISE": "constexpr", "POW2": "constexpr", "BLOCK": "constexpr", "SUB_M": "constexpr"}  # fmt: skip
    cvt = "e4m3x2" if fp8_ty == "fp8e4nv" else "e5m2x2"
    amd = "v_cvt_scalef32_pk_fp8_f32" if fp8_ty == "fp8e4nv" else "v_cvt_scalef32_pk_bf8_f32"
    return KernelSpec(
        f"quantize_1x128_dual[{in_ty}->{fp8_ty},row={int(rowwise)},col={int(columnwise)},sub_m={sub_m}"
        f"{',ragged' if ragged else ''}]",
        quantize_act._quantize_1x128_dual_kernel,
        sig,
        {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": True, "BLOCK": 128, "SUB_M": sub_m},
        num_warps,
        quantize_act.NUM_STAGES,
        # the FP8 conversion, and the NaN-propagating amax (a plain max would hide NaN tiles)
        {"sm90": [rf"cvt\.rn\.satfinite\.{cvt}\.f32", r"max\.NaN\.f32"], "gfx950": [amd, r"v_maximum3?_f32"]},
        ints_divisible=not ragged,
    )


def _quant_weight_spec() -> KernelSpec:
    sig = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "st_ptr": "*fp32",
           "N": "i32", "K": "i32", "stride_wn": "i32", "stride_s": "i32", "stride_st": "i32", "fp8_max": "fp32",
           "amax_eps": "fp32", "in_max": "fp32", "POW2": "constexpr", "BLOCK": "constexpr", "SUB_M": "constexpr"}  # fmt: skip
    return KernelSpec(
        "quantize_128x128[bf16->fp8e4nv]",
        quantize_weight._quantize_128x128_kernel,
        sig,
        {"POW2": True, "BLOCK": 128, "SUB_M": quantize_weight.SUB_M},
        quantize_weight.NUM_WARPS,
        quantize_weight.NUM_STAGES,
        {
            "sm90": [r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"max\.NaN\.f32"],
            "gfx950": ["v_cvt_scalef32_pk_fp8_f32", r"v_maximum3?_f32"],
        },
    )


def _gemm_spec(direction: str) -> KernelSpec:
    b_2d = direction != "wgrad"
    out_ty = "fp32" if direction == "wgrad" else "bf16"
    cfg = gemm.default_config()
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": f"*{out_ty}", "a_s_ptr": "*fp32", "b_s_ptr": "*fp32",
           "bias_ptr": f"*{out_ty}", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32",
           "stride_cm": "i32", "stride_as": "i32", "stride_bs": "i32", "B_2D": "constexpr", "HAS_BIAS": "constexpr",
           "ACCUMULATE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "GROUP_M": "constexpr"}  # fmt: skip
    cons = {"B_2D": b_2d, "HAS_BIAS": direction == "fwd", "ACCUMULATE": direction == "wgrad",
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 128, "GROUP_M": cfg.group_m}  # fmt: skip
    return KernelSpec(
        f"blockwise_gemm[{direction}]",
        gemm._blockwise_gemm_kernel,
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
        _gemm_spec("fwd"),
        _gemm_spec("wgrad"),
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
    """A compiled Gluon quantizer (quantize_act_gluon.py, quantize_weight_gluon.py): registers,
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
    from .hopper import SMEM_LIMIT

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
    k = triton.compile(src, target=TARGETS[target], options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AOT-compile the Triton kernels for sm_90 and gfx950 and check them")
    ap.add_argument("--json", type=Path, help="write the reports as JSON")
    ap.add_argument("--dump", type=Path, help="write PTX/SASS/AMDGCN of every kernel into this folder")
    args = ap.parse_args(argv)
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
