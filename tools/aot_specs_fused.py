"""Ahead-of-time compile specs of the fused-op kernels (norm, SwiGLU, RoPE), for ``tools/aot_triton.py``.

``kernel_specs()`` returns plain dicts with ``aot_triton.KernelSpec``'s fields (``aot_triton`` imports this
module), one per variant the wrappers launch, with the configs of ``kernels/triton/heuristics.py``: every
kernel compiles with
``enable_fp_fusion=False`` and on sm_90 its PTX must hold no ``fma.rn.f32`` (a fused multiply-add
would round once where the spec rounds twice; IEEE divisions and square roots expand to FMAs only
later, in SASS).
"""

from __future__ import annotations

from primus_fp8_plugin.kernels.triton import fused_act, norm, rope, swiglu
from primus_fp8_plugin.kernels.triton import heuristics as portable
from primus_fp8_plugin.kernels.triton.fused_math import FP_OPTIONS, OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU

NO_FMA = r"\A(?![\s\S]*fma\.rn\.f32)"
"""A regex that matches (at the start) only where the text holds no ``fma.rn.f32``."""

_CVT = {"bf16": r"cvt\.rn\.bf16(x2)?\.f32", "fp32": r"st\.global"}


def _sig(names_types: str) -> dict[str, str]:
    """``"a:*bf16 b:i32 C:constexpr"`` -> {"a": "*bf16", ...} (signatures are long)."""
    return dict(item.split(":") for item in names_types.split())


def _spec(name, fn, sig, constexprs, num_warps, num_stages, sm90, gfx950, ints_divisible=True) -> dict:
    return {
        "name": name, "fn": fn, "signature": _sig(sig), "constexprs": constexprs, "num_warps": num_warps,
        "num_stages": num_stages, "expect": {"sm90": [NO_FMA, *sm90], "gfx950": gfx950},
        "ints_divisible": ints_divisible, "options": dict(FP_OPTIONS),
    }  # fmt: skip


# (op, input dtype, ragged, columnwise): aligned and ragged launches, with and without the columnwise
# copy, in bf16; fp32 where it needs the most registers (SwiGLU: two tiles) and ragged LayerNorm
_QUANTIZE_VARIANTS = [
    *((op, "bf16", ragged, col) for op in ("layernorm", "rmsnorm", "swiglu") for ragged, col in
      ((False, True), (False, False), (True, True))),
    ("swiglu", "fp32", False, True),
    ("layernorm", "fp32", True, True),
]  # fmt: skip
_OPS = {"layernorm": (OP_LAYERNORM, True), "rmsnorm": (OP_RMSNORM, False), "swiglu": (OP_SWIGLU, False)}


def _quantize_specs() -> list[dict]:
    specs = []
    for op_name, in_ty, ragged, colwise in _QUANTIZE_VARIANTS:
        op, has_beta = _OPS[op_name]
        cfg = (portable.FUSED_QUANT_RAGGED if ragged else portable.FUSED_QUANT)[op]
        sig = (f"src_ptr:*{in_ty} row_q_ptr:*fp8e4nv row_s_ptr:*fp32 col_q_ptr:*fp8e4nv col_s_ptr:*fp32 "
               f"mean_ptr:*fp32 rstd_ptr:*fp32 gamma_ptr:*{in_ty} beta_ptr:*{in_ty} M:i32 K:i32 M_PAD:i32 "
               "K_PAD:i32 stride_sm:i32 up_offset:i32 fp8_max:fp32 amax_eps:fp32 in_max:fp32 OP:constexpr "
               "HAS_BETA:constexpr ROWWISE:constexpr COLWISE:constexpr POW2:constexpr BLOCK:constexpr "
               "SUB_M:constexpr")  # fmt: skip
        cons = {"OP": op, "HAS_BETA": has_beta, "ROWWISE": True, "COLWISE": colwise, "POW2": True, "BLOCK": 128,
                "SUB_M": cfg.sub_m}  # fmt: skip
        name = f"quantize_fused[{op_name},{in_ty},col={int(colwise)}{',ragged' if ragged else ''}]"
        specs.append(_spec(
            name, fused_act.quantize_fused_kernel, sig, cons, cfg.num_warps, cfg.num_stages,
            [r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"max\.NaN\.f32"], ["v_cvt_scalef32_pk_fp8_f32", r"v_maximum3?_f32"],
            ints_divisible=not ragged,
        ))  # fmt: skip
    return specs


def _apply_specs() -> list[dict]:
    specs = []
    for op_name, op, has_beta in [("layernorm", 0, True), ("rmsnorm", 1, False), ("swiglu", 2, False)]:
        sig = ("src_ptr:*bf16 y_ptr:*bf16 mean_ptr:*fp32 rstd_ptr:*fp32 gamma_ptr:*bf16 beta_ptr:*bf16 M:i32 K:i32 "
               "stride_sm:i32 up_offset:i32 OP:constexpr HAS_BETA:constexpr BLOCK_M:constexpr BLOCK_K:constexpr")  # fmt: skip
        cfg = portable.FUSED_APPLY
        cons = {"OP": op, "HAS_BETA": has_beta, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_n}
        specs.append(_spec(f"fused_apply[{op_name},bf16]", fused_act.apply_kernel, sig, cons, cfg.num_warps, 3,
                           [_CVT["bf16"]], [r"v_(cvt_pk_bf16_f32|perm_b32|lshrrev)"]))  # fmt: skip
    return specs


def _norm_specs() -> list[dict]:
    specs = []
    for rms in (False, True):
        kind = "rmsnorm" if rms else "layernorm"
        sig = ("x_ptr:*bf16 mean_ptr:*fp32 rstd_ptr:*fp32 M:i32 H:i32 stride_xm:i32 eps:fp32 RMS:constexpr R:constexpr "
               "U:constexpr")  # fmt: skip
        for vname, cfg in portable.NORM_STATS.items():
            cons = {"RMS": rms, "R": cfg.rows, "U": cfg.unroll}
            specs.append(_spec(f"norm_stats[{kind},bf16,{vname}]", norm.stats_kernel, sig, cons, cfg.warps, 3,
                               [r"sqrt\.rn\.f32", r"div\.rn\.f32"], [r"v_sqrt_f32|v_div_scale_f32"]))  # fmt: skip
        sig = ("dy_ptr:*bf16 x_ptr:*bf16 mean_ptr:*fp32 rstd_ptr:*fp32 gamma_ptr:*bf16 dx_ptr:*bf16 pg_ptr:*fp32 "
               "pb_ptr:*fp32 c_ptr:*fp32 M:i32 H:i32 stride_dy:i32 stride_x:i32 RMS:constexpr DGAMMA:constexpr "
               "DBETA:constexpr G:constexpr U:constexpr W:constexpr SUB:constexpr REVERSE:constexpr")  # fmt: skip
        g = norm.NORM_BWD_ROWS
        for vname, cfg in portable.NORM_BWD.items():
            cons = {"RMS": rms, "DGAMMA": True, "DBETA": not rms, "G": g, "U": cfg.unroll, "W": cfg.width,
                    "SUB": cfg.sub, "REVERSE": cfg.reverse}  # fmt: skip
            specs.append(_spec(f"norm_bwd[{kind},bf16,{vname}]", norm.bwd_kernel, sig, cons, cfg.warps, cfg.stages,
                               [r"div\.rn\.f32", _CVT["bf16"]], [r"v_div_scale_f32"]))  # fmt: skip
    sig = "p_ptr:*fp32 out_ptr:*bf16 NG:i32 H:i32 N:constexpr"
    for cols, warps in sorted({(cfg.colsum_cols, cfg.colsum_warps) for cfg in portable.NORM_BWD.values()}):
        specs.append(_spec(f"norm_column_sum[bf16,N={cols}]", norm.column_sum_kernel, sig, {"N": cols},
                           warps, 3, [_CVT["bf16"]], [r"global_store"]))  # fmt: skip
    return specs


def _swiglu_rope_specs() -> list[dict]:
    sig = ("dy_ptr:*bf16 h_ptr:*bf16 dh_ptr:*bf16 M:i32 F:i32 stride_dy:i32 stride_h:i32 BLOCK_M:constexpr "
           "BLOCK_F:constexpr")  # fmt: skip
    specs = [_spec("swiglu_bwd[bf16]", swiglu.swiglu_bwd_kernel, sig,
                   {"BLOCK_M": portable.SWIGLU_BWD.block_m, "BLOCK_F": portable.SWIGLU_BWD.block_n},
                   portable.SWIGLU_BWD.num_warps, 3,
                   [r"div\.rn\.f32", _CVT["bf16"]], [r"v_div_scale_f32"])]  # fmt: skip
    sig = ("t_ptr:*bf16 cos_ptr:*bf16 sin_ptr:*bf16 out_ptr:*bf16 B:i32 NH:i32 D:i32 ROT:i32 stride_ts:i32 "
           "stride_tb:i32 stride_th:i32 stride_cs:i32 stride_cb:i32 INTERLEAVED:constexpr BACKWARD:constexpr "
           "BLOCK_H:constexpr BLOCK_D:constexpr")  # fmt: skip
    for interleaved, backward in ((False, False), (False, True), (True, True)):
        cons = {"INTERLEAVED": interleaved, "BACKWARD": backward, "BLOCK_H": portable.ROPE.tile_elements // 128,
                "BLOCK_D": 128}  # fmt: skip
        specs.append(_spec(f"rope[bf16,d=128,interleaved={int(interleaved)},bwd={int(backward)}]", rope.rope_kernel,
                           sig, cons, portable.ROPE.num_warps, 3, [_CVT["bf16"]], [r"global_store"]))  # fmt: skip
    return specs


def kernel_specs() -> list[dict]:
    """Every fused-op kernel variant to compile ahead of time (``aot.KernelSpec`` fields)."""
    return _quantize_specs() + _apply_specs() + _norm_specs() + _swiglu_rope_specs()
