"""The grouped (MoE) Triton kernels' variants for the ahead-of-time check (sm_90 and gfx950), as plain
keyword dicts of ``tools/aot_triton.py``'s ``KernelSpec`` (``aot_triton`` imports this module), with the
configs of ``kernels/triton/heuristics.py``.

Each variant is compiled as the wrappers launch it: the int arguments that the launch specialises as
multiples of 16 (K-derived sizes and strides, the padded token capacity) are named in ``divisible``; the
token counts and the number of experts are not (ragged routings).
"""

from __future__ import annotations

from primus_fp8_plugin.kernels.triton import gemm_grouped, quantize_grouped
from primus_fp8_plugin.kernels.triton import heuristics as portable

_FP8_SM90 = {"fp8e4nv": "e4m3x2", "fp8e5": "e5m2x2"}
_FP8_GFX950 = {"fp8e4nv": "v_cvt_scalef32_pk_fp8_f32", "fp8e5": "v_cvt_scalef32_pk_bf8_f32"}


def _quant_act(fp8_ty: str, ragged: bool) -> dict:
    cfg = portable.act_quant_config(16, 17 if ragged else 16)
    sub_m, num_warps = cfg.sub_m, cfg.num_warps
    sig = {"x_ptr": "*bf16", "row_q_ptr": f"*{fp8_ty}", "row_s_ptr": "*fp32", "col_q_ptr": f"*{fp8_ty}",
           "col_s_ptr": "*fp32", "offsets_ptr": "*i32", "padded_ptr": "*i32", "probs_ptr": "*bf16", "rows_ptr": "*i32",
           "E": "i32",
           "T": "i32", "K": "i32", "T_PAD": "i32", "CAP": "i32", "K_PAD": "i32", "stride_xm": "i32", "up_offset": "i32",
           "fp8_max": "fp32", "amax_eps": "fp32", "in_max": "fp32", "ROWWISE": "constexpr", "COLWISE": "constexpr",
           "POW2": "constexpr", "BLOCK": "constexpr", "SUB_M": "constexpr", "BLOCK_E": "constexpr", "SWIGLU": "constexpr",
           "HAS_PROBS": "constexpr", "GATHER": "constexpr"}  # fmt: skip
    return dict(
        name=f"quantize_grouped_1x128[bf16->{fp8_ty},sub_m={sub_m}{',ragged' if ragged else ''}]",
        fn=quantize_grouped.quantize_grouped_1x128_kernel,
        signature=sig,
        constexprs={"ROWWISE": True, "COLWISE": True, "POW2": True, "BLOCK": 128, "SUB_M": sub_m, "BLOCK_E": 16,
                    "SWIGLU": False, "HAS_PROBS": False, "GATHER": False},
        num_warps=num_warps,
        num_stages=cfg.num_stages,
        expect={
            "sm90": [rf"cvt\.rn\.satfinite\.{_FP8_SM90[fp8_ty]}\.f32", r"max\.NaN\.f32"],
            "gfx950": [_FP8_GFX950[fp8_ty], r"v_maximum3?_f32"],
        },
        ints_divisible=False,
        divisible=("CAP",) if ragged else ("K", "K_PAD", "CAP", "stride_xm"),
    )


def _quant_weight_batched() -> dict:
    cfg = portable.weight_quant_config()
    sig = {"w_table_ptr": "*i64", "w0_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "st_ptr": "*fp32", "N": "i32", "K": "i32", "stride_wn": "i32", "stride_we": "i32", "stride_s": "i32",
           "stride_st": "i32", "stride_se": "i32", "stride_ste": "i32", "fp8_max": "fp32", "amax_eps": "fp32",
           "in_max": "fp32", "W_TABLE": "constexpr", "TABLE_ALIGN": "constexpr", "POW2": "constexpr", "BLOCK": "constexpr",
           "SUB_M": "constexpr"}  # fmt: skip
    return dict(
        name="quantize_128x128_batched[bf16->fp8e4nv,table]",
        fn=quantize_grouped.quantize_128x128_batched_kernel,
        signature=sig,
        constexprs={"W_TABLE": True, "TABLE_ALIGN": 16, "POW2": True, "BLOCK": 128, "SUB_M": cfg.sub_m},
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        expect={
            # the weights read through the aligned table in 16-byte loads
            "sm90": [r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"max\.NaN\.f32", r"ld\.global(\.\w+)*\.v4\.b32"],
            "gfx950": ["v_cvt_scalef32_pk_fp8_f32", r"v_maximum3?_f32"],
        },
        ints_divisible=False,
        divisible=("N", "K", "stride_wn", "stride_we"),
    )


def _mma_expect(a_ty: str, main_grad: bool = False) -> dict:
    a = "e5m2" if a_ty == "fp8e5" else "e4m3"
    # main_grad: read and written through the aligned table in 16-byte accesses
    vec = [r"ld\.global(\.\w+)*\.v4\.b32", r"st\.global(\.\w+)*\.v4\.b32"] if main_grad else []
    return {"sm90": [rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{a}\.e4m3", r"QGMMA", *vec],
            "gfx950": [r"v_mfma_f32_\w+_f8f6f4"]}  # fmt: skip


def _gemm(direction: str, a_ty: str = "fp8e4nv") -> dict:
    cfg = portable.gemm_config()
    sig = {"a_ptr": f"*{a_ty}", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "a_s_ptr": "*fp32", "b_s_ptr": "*fp32",
           "bias_ptr": "*bf16", "offsets_ptr": "*i32", "padded_ptr": "*i32", "E": "i32", "N": "i32", "K": "i32",
           "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_as": "i32",
           "stride_bse": "i32", "stride_bs": "i32", "stride_biase": "i32", "HAS_BIAS": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
           "BLOCK_E": "constexpr"}  # fmt: skip
    cons = {"HAS_BIAS": direction == "fwd", "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 128,
            "GROUP_M": cfg.group_m, "BLOCK_E": 16}  # fmt: skip
    return dict(
        name=f"grouped_gemm[{direction}{',' + a_ty if a_ty != 'fp8e4nv' else ''}]",
        fn=gemm_grouped.grouped_gemm_kernel,
        signature=sig,
        constexprs=cons,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        expect=_mma_expect(a_ty),
        ints_divisible=False,
        divisible=("N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_biase"),
    )


def _wgrad(accumulate: bool, a_ty: str = "fp8e4nv", tokens_per_expert: int = 256) -> dict:
    cfg = portable.grouped_wgrad_config(tokens_per_expert)
    tile = f",{cfg.block_m}x{cfg.block_n}"
    out_ty = "fp32" if accumulate else "bf16"
    sig = {"a_ptr": f"*{a_ty}", "b_ptr": "*fp8e4nv", "c_table_ptr": "*i64" if accumulate else f"*{out_ty}",
           "c0_ptr": f"*{out_ty}", "a_s_ptr": "*fp32", "b_s_ptr": "*fp32", "offsets_ptr": "*i32", "padded_ptr": "*i32",
           "M": "i32", "N": "i32", "CAP": "i32", "stride_as": "i32", "stride_bs": "i32", "stride_ce": "i32",
           "C_TABLE": "constexpr", "TABLE_ALIGN": "constexpr", "ACCUMULATE": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr"}  # fmt: skip
    cons = {"C_TABLE": accumulate, "TABLE_ALIGN": 16 if accumulate else 1, "ACCUMULATE": accumulate,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 128, "GROUP_M": cfg.group_m}  # fmt: skip
    return dict(
        name=f"grouped_wgrad[{'main_grad' if accumulate else 'bf16'}{',' + a_ty if a_ty != 'fp8e4nv' else ''}{tile}]",
        fn=gemm_grouped.grouped_wgrad_kernel,
        signature=sig,
        constexprs=cons,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        expect=_mma_expect(a_ty, accumulate),
        ints_divisible=False,
        divisible=("M", "N", "CAP", "stride_as", "stride_bs") + (() if accumulate else ("stride_ce",)),
    )


def grouped_kernel_specs() -> list[dict]:
    """Keyword arguments of one ``KernelSpec`` per grouped kernel variant the wrappers launch."""
    return [
        _quant_act("fp8e4nv", ragged=False),
        _quant_act("fp8e5", ragged=False),
        _quant_act("fp8e4nv", ragged=True),  # K not a multiple of 16
        _quant_weight_batched(),
        _gemm("fwd"),
        _gemm("dgrad"),
        _gemm("dgrad", "fp8e5"),  # HYBRID: E5M2 output gradients against the E4M3 W^T
        _wgrad(accumulate=True),
        _wgrad(accumulate=False),
        _wgrad(accumulate=True, a_ty="fp8e5"),  # HYBRID: E5M2 dY^T against the E4M3 X
        _wgrad(accumulate=True, tokens_per_expert=1024),  # many tokens per expert: the dense tile
        _wgrad(accumulate=False, tokens_per_expert=1024),
    ]
