"""The Triton backend: quantization and blockwise GEMM kernels for NVIDIA Hopper and AMD gfx950.

GEMMs: on Hopper (sm_90) the warp-specialised Gluon kernel (``gemm_gluon.py``) wherever its TMA
layout rules hold (K % 16 == 0, N % 8 == 0, 16-byte aligned operands); the portable Triton kernel
(``gemm.py``) everywhere else (other shapes, gfx950, the CPU interpreter).
Quantization: on Hopper the Gluon kernels (``quantize_act_gluon.py``, ``quantize_weight_gluon.py``;
both dims multiples of 16), else the Triton ones.
Fused ops: LayerNorm / RMSNorm and SwiGLU with their output quantized to FP8 directly (``norm.py``,
``swiglu.py``, ``fused_act.py``; on Hopper the quantizing kernel is Gluon, ``fused_act_gluon.py``,
where M, K and the row stride are multiples of 16), RoPE (``rope.py``), bit for bit the reference
backend's.

On a CPU it runs through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before import
(for tests: slow, exact once ``interpreter_fix`` corrects the interpreter's float casts).
"""

from __future__ import annotations

import os

import torch

from ..kernels.sm90.gemm import blockwise_gemm_gluon
from ..kernels.sm90.quantize_act import quantize_1x128_dual_gluon
from ..kernels.sm90.quantize_weight import quantize_128x128_gluon
from ..kernels.sm90.target import GluonUnsupported
from ..kernels.sm90.target import runs_on as runs_on_hopper
from ..kernels.triton import norm, rope, swiglu
from ..kernels.triton.gemm import blockwise_gemm
from ..kernels.triton.quantize_act import quantize_1x128_dual
from ..kernels.triton.quantize_weight import quantize_128x128
from .base import Availability, Backend
from .triton_grouped import TritonGrouped

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:
    from ..kernels.triton import interpreter_fix

    interpreter_fix.apply()


def device_availability(device: torch.device) -> Availability:
    """Whether Triton kernels run on ``device``: Hopper-class NVIDIA, AMD gfx950, or the CPU interpreter."""
    if INTERPRET:
        if device.type == "cpu":
            return Availability(True, "CPU interpreter (TRITON_INTERPRET=1): exact but slow, for tests", auto=False)
        return Availability(False, "TRITON_INTERPRET=1 is set: Triton kernels run on CPU tensors only")
    if device.type != "cuda":
        return Availability(False, f"Triton kernels need a GPU (or TRITON_INTERPRET=1 for CPU tensors), got {device}")
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "")
        if not arch.startswith("gfx950"):
            return Availability(False, f"AMD GPU {arch} is not gfx950 (MI355X); FP8 kernels here target gfx950 only")
        return Availability(True)
    if (props.major, props.minor) < (8, 9):
        return Availability(False, f"{props.name} (sm_{props.major}{props.minor}) has no FP8 tensor cores; need sm_89+")
    return Availability(True)


def _hopper_or_portable(device, hopper_fn, portable_fn, *args, **kwargs):
    """``hopper_fn(*args, **kwargs)`` on Hopper unless it raises ``GluonUnsupported`` (each Gluon
    wrapper raises it before launching anything, for valid inputs it does not take), else
    ``portable_fn`` with the same arguments and contract. Wrong inputs raise from the wrappers' own
    checks."""
    if runs_on_hopper(device):
        try:
            return hopper_fn(*args, **kwargs)
        except GluonUnsupported:
            pass
    return portable_fn(*args, **kwargs)


def hopper_or_portable_gemm(a, a_scale_inv, b, b_scale_inv, **kwargs) -> torch.Tensor:
    """``blockwise_gemm``: the Gluon kernel where it applies (TMA alignment, K % 16, N % 8), else the
    portable one."""
    return _hopper_or_portable(a.device, blockwise_gemm_gluon, blockwise_gemm,
                               a, a_scale_inv, b, b_scale_inv, **kwargs)  # fmt: skip


def hopper_or_portable_act_quant(x, params, *, rowwise, columnwise):
    """``quantize_1x128_dual``: the Gluon kernel where it applies (dims % 16), else the Triton one."""
    return _hopper_or_portable(x.device, quantize_1x128_dual_gluon, quantize_1x128_dual,
                               x, params, rowwise=rowwise, columnwise=columnwise)  # fmt: skip


def hopper_or_portable_weight_quant(w, params):
    """``quantize_128x128``: the Gluon kernel where it applies (dims % 16), else the Triton one."""
    return _hopper_or_portable(w.device, quantize_128x128_gluon, quantize_128x128, w, params)


class TritonBackend(TritonGrouped, Backend):
    """Triton kernels for all five operations: the Gluon kernels on Hopper, the portable ones elsewhere;
    their grouped (MoE) forms (``grouped.py``) and the fused ops.

    Args:
        blockwise_gemm: the GEMM the three GEMM methods call, with ``blockwise_gemm``'s contract
            (``C = A @ B^T`` with per-128-K-block promotion, scales in TE's layouts, triton/gemm.py);
            another backend that brings its own GEMM kernel (FlyDSL) holds a TritonBackend built with it.
    """

    name = "triton"

    def __init__(self, blockwise_gemm=hopper_or_portable_gemm) -> None:
        self._blockwise_gemm = blockwise_gemm

    def availability(self, device):
        return device_availability(device)

    def quantize_act(self, x, params, *, rowwise, columnwise):
        return hopper_or_portable_act_quant(x, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight(self, w, params):
        return hopper_or_portable_weight_quant(w, params)

    def gemm_fwd(self, x, w, bias, out_dtype):
        return self._blockwise_gemm(
            x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv,
            b_block_dim=2, out_dtype=out_dtype, bias=bias,
        )  # fmt: skip

    def gemm_dgrad(self, dy, w, out_dtype):
        return self._blockwise_gemm(
            dy.rowwise_data, dy.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv,
            b_block_dim=2, out_dtype=out_dtype,
        )  # fmt: skip

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        return self._blockwise_gemm(
            dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data, x.columnwise_scale_inv,
            b_block_dim=1, out_dtype=out_dtype, accumulate_into=accumulate_into,
        )  # fmt: skip

    # fused ops: bit for bit the reference backend's (reference_fused.py)
    def norm_fwd(self, x, gamma, beta, eps, normalization):
        return norm.norm_fwd(x, gamma, beta, eps, normalization)

    def quantize_norm_act(self, x, gamma, beta, eps, normalization, params, *, rowwise, columnwise):
        return norm.quantize_norm_act(x, gamma, beta, eps, normalization, params, rowwise=rowwise, columnwise=columnwise)

    def norm_bwd(self, dy, x, gamma, mean, rstd, *, need_dgamma, need_dbeta):
        return norm.norm_bwd(dy, x, gamma, mean, rstd, need_dgamma=need_dgamma, need_dbeta=need_dbeta)

    def swiglu_fwd(self, h):
        return swiglu.swiglu_fwd(h)

    def quantize_swiglu_act(self, h, params, *, rowwise, columnwise):
        return swiglu.quantize_swiglu_act(h, params, rowwise=rowwise, columnwise=columnwise)

    def swiglu_bwd(self, dy, h):
        return swiglu.swiglu_bwd(dy, h)

    def rope(self, t, cos, sin, *, interleaved, backward):
        return rope.rope(t, cos, sin, interleaved=interleaved, backward=backward)
