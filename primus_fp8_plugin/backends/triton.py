"""The ``triton`` backend: the Triton kernels (``kernels/``) for NVIDIA Hopper and AMD gfx950, and for CPU
tensors through Triton's interpreter (tests).

A composition, no kernel of its own: for each operation it asks ``kernels/sm90/heuristics.py`` whether a
Hopper Gluon kernel runs the call (and with which config) and otherwise runs the portable Triton kernel
(``kernels/triton/``, configs from ``kernels/triton/heuristics.py``): the same bits either way.

* Quantization: the Gluon quantizers where both dims are multiples of 16, else the Triton ones.
* GEMMs: the warp-specialised Gluon GEMM wherever its TMA rules hold (K % 16 == 0, N % 8 == 0, 16-byte
  aligned operands), the portable GEMM elsewhere (other shapes, gfx950, the interpreter).
* Grouped (MoE) operations: one launch per operation for all experts (Gluon grouped GEMMs on Hopper where
  they apply; the portable ones otherwise, and for every wgrad into ``main_grad``), except the weight
  quantization of a few experts on Hopper: one dense Gluon launch per expert.
* W^T on demand (weights held as W only): the portable transpose kernel (``transpose_weight.py``).
* Fused ops: LayerNorm / RMSNorm and SwiGLU with their output quantized to FP8 directly (the Gluon
  fused quantizer on Hopper where M, K and the row stride are multiples of 16), RoPE; bit for bit the
  reference backend's. Their launch variants: ``FusedVariants``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.sm90 import heuristics as sm90
from ..kernels.sm90.fused_act import quantize_fused_gluon
from ..kernels.sm90.gemm import blockwise_gemm_gluon
from ..kernels.sm90.gemm_grouped import grouped_gemm_gluon, grouped_wgrad_gluon
from ..kernels.sm90.quantize_act import quantize_1x128_dual_gluon
from ..kernels.sm90.quantize_grouped import quantize_128x128_per_expert_gluon
from ..kernels.sm90.quantize_weight import quantize_128x128_gluon
from ..kernels.triton import INTERPRETED, fused_act, norm, permute, rope, swiglu
from ..kernels.triton import heuristics as portable
from ..kernels.triton.fused_math import OP_SWIGLU
from ..kernels.triton.gemm import blockwise_gemm
from ..kernels.triton.gemm_grouped import grouped_gemm, grouped_wgrad
from ..kernels.triton.quantize_act import quantize_1x128_dual
from ..kernels.triton.quantize_grouped import quantize_128x128_batched, quantize_grouped_1x128
from ..kernels.triton.quantize_weight import quantize_128x128
from ..kernels.triton.transpose_weight import transpose_128x128
from .base import Availability, Backend


def device_availability(device: torch.device) -> Availability:
    """Whether Triton kernels run on ``device``: Hopper-class NVIDIA, AMD gfx950, or the CPU interpreter."""
    if INTERPRETED:
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


def hopper_or_portable_gemm(a, a_scale_inv, b, b_scale_inv, *, b_block_dim, out_dtype, bias=None, accumulate_into=None):
    """The portable ``blockwise_gemm``'s contract (kernels/triton/gemm.py): the Gluon GEMM where the sm90
    heuristics pick it, else the portable one."""
    cfg = sm90.dense_gemm(a, b, b_block_dim=b_block_dim, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into)
    gemm = blockwise_gemm if cfg is None else blockwise_gemm_gluon
    kw = {} if cfg is None else {"config": cfg}
    return gemm(a, a_scale_inv, b, b_scale_inv, b_block_dim=b_block_dim, out_dtype=out_dtype, bias=bias,
                accumulate_into=accumulate_into, **kw)  # fmt: skip


def hopper_or_portable_act_quant(x, params, *, rowwise, columnwise):
    """``quantize_1x128_dual``: the Gluon kernel where the sm90 heuristics pick it, else the Triton one."""
    quantize = quantize_1x128_dual_gluon if sm90.act_quant(x, params) else quantize_1x128_dual
    return quantize(x, params, rowwise=rowwise, columnwise=columnwise)


def hopper_or_portable_weight_quant(w, params):
    """``quantize_128x128``: the Gluon kernel where the sm90 heuristics pick it, else the Triton one."""
    return (quantize_128x128_gluon if sm90.weight_quant(w, params) else quantize_128x128)(w, params)


@dataclass(frozen=True)
class FusedVariants:
    """The launch variants the fused ops run, by name: ``stats`` and ``bwd`` of the norm kernels
    (``kernels/triton/heuristics.py``: ``NORM_STATS``, ``NORM_BWD``), ``gluon`` of the Hopper fused quantizer
    (``kernels/sm90/heuristics.py``: ``FUSED_QUANT``). Every variant computes the same bits; the defaults
    are the measured best (benchmarks/bench_fused.py --variants)."""

    stats: str = portable.NORM_STATS_DEFAULT
    bwd: str = portable.NORM_BWD_DEFAULT
    gluon: str = sm90.FUSED_QUANT_DEFAULT

    def __post_init__(self):
        for kind, table in (("stats", portable.NORM_STATS), ("bwd", portable.NORM_BWD), ("gluon", sm90.FUSED_QUANT)):
            if getattr(self, kind) not in table:
                raise ValueError(f"{kind} variants are {sorted(table)}, got {getattr(self, kind)!r}")


class TritonBackend(Backend):
    """Triton kernels for every operation: the Gluon kernels on Hopper where they apply, the portable ones
    elsewhere; the grouped (MoE) forms and the fused ops.

    Args:
        blockwise_gemm: the dense GEMM the three GEMM methods call, with the portable ``blockwise_gemm``'s
            contract (``C = A @ B^T`` with per-128-K-block promotion, scales in TE's layouts); another
            backend that brings its own GEMM kernel (FlyDSL) holds a TritonBackend built with it.
        fused: the fused ops' launch variants.
    """

    name = "triton"

    def __init__(self, blockwise_gemm=hopper_or_portable_gemm, fused: FusedVariants | None = None) -> None:
        self._blockwise_gemm = blockwise_gemm
        self.fused = fused or FusedVariants()
        self._stats = portable.norm_stats_config(self.fused.stats)
        self._bwd = portable.norm_bwd_config(self.fused.bwd)

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

    def transpose_weight(self, w):
        return w.with_columnwise(*transpose_128x128(w.rowwise_data, w.rowwise_scale_inv))

    def transpose_weight_grouped(self, w):
        return w.with_columnwise(*transpose_128x128(w.rowwise_data, w.rowwise_scale_inv))

    # ---- grouped (mixture-of-experts) operations: the same bits as a loop of the dense ones
    def quantize_act_grouped(self, x, layout, params, *, rowwise, columnwise, rows=None):
        return quantize_grouped_1x128(x, layout, params, rowwise=rowwise, columnwise=columnwise, rows=rows)

    def quantize_swiglu_act_grouped(self, h, layout, params, *, rowwise, columnwise, probs=None):
        return quantize_grouped_1x128(h, layout, params, rowwise=rowwise, columnwise=columnwise, swiglu=True, probs=probs)

    def quantize_weight_grouped(self, weights, params, out=None):
        if sm90.weight_quant_per_expert(weights, params):
            return quantize_128x128_per_expert_gluon(weights, params, out)
        return quantize_128x128_batched(weights, params, out)

    def _grouped_gemm(self, a, a_s, b, b_s, layout, out_dtype, bias=None):
        cfg = sm90.grouped_gemm(a, b, out_dtype, bias)
        if cfg is None:
            return grouped_gemm(a, a_s, b, b_s, layout, out_dtype=out_dtype, bias=bias)
        return grouped_gemm_gluon(a, a_s, b, b_s, layout, out_dtype=out_dtype, config=cfg, bias=bias)

    def gemm_fwd_grouped(self, x, w, bias, out_dtype):
        return self._grouped_gemm(x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv, x.layout,
                                  out_dtype, bias)  # fmt: skip

    def gemm_dgrad_grouped(self, dy, w, out_dtype):
        return self._grouped_gemm(dy.rowwise_data, dy.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv,
                                  dy.layout, out_dtype)  # fmt: skip

    def gemm_wgrad_grouped(self, dy, x, out_dtype, accumulate_into):
        args = (dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data, x.columnwise_scale_inv, x.layout)
        cfg = sm90.grouped_wgrad(dy.columnwise_data, x.columnwise_data, out_dtype, accumulate_into)
        if cfg is None:
            return grouped_wgrad(*args, out_dtype=out_dtype, accumulate_into=accumulate_into)
        return grouped_wgrad_gluon(*args, out_dtype=out_dtype, config=cfg, accumulate_into=accumulate_into)

    # ---- fused ops: bit for bit the reference backend's (reference_fused.py)
    def _quantize_fused(self, src, op, params, *, k, rowwise, columnwise, **producer):
        cfg = sm90.fused_quant(src, k, params, self.fused.gluon)
        if cfg is None:
            return fused_act.quantize_fused(src, op, params, k=k, rowwise=rowwise, columnwise=columnwise, **producer)
        return quantize_fused_gluon(src, op, params, k=k, config=cfg, rowwise=rowwise, columnwise=columnwise, **producer)

    def norm_fwd(self, x, gamma, beta, eps, normalization):
        return norm.norm_fwd(x, gamma, beta, eps, normalization, self._stats)

    def quantize_norm_act(self, x, gamma, beta, eps, normalization, params, *, rowwise, columnwise):
        gamma, beta = norm.contiguous(gamma, beta)
        mean, rstd = norm.norm_stats(x, eps, normalization, self._stats)
        xq = self._quantize_fused(x, norm.norm_op(normalization), params, k=x.shape[1], mean=mean, rstd=rstd, gamma=gamma,
                                  beta=beta, rowwise=rowwise, columnwise=columnwise)  # fmt: skip
        return xq, mean, rstd

    def norm_bwd(self, dy, x, gamma, mean, rstd, *, need_dgamma, need_dbeta):
        return norm.norm_bwd(dy, x, gamma, mean, rstd, need_dgamma=need_dgamma, need_dbeta=need_dbeta, config=self._bwd)

    def swiglu_fwd(self, h):
        return swiglu.swiglu_fwd(h)

    def quantize_swiglu_act(self, h, params, *, rowwise, columnwise):
        f = swiglu.swiglu_width(h)
        return self._quantize_fused(h, OP_SWIGLU, params, k=f, up_offset=f, rowwise=rowwise, columnwise=columnwise)

    def swiglu_bwd(self, dy, h):
        return swiglu.swiglu_bwd(dy, h)

    def rope(self, t, cos, sin, *, interleaved, backward):
        return rope.rope(t, cos, sin, interleaved=interleaved, backward=backward)

    def unpermute(self, y, sorted_indices, token_rows, token_offsets, probs):
        acc = y.dtype if probs is None else torch.promote_types(y.dtype, probs.dtype)
        return permute.unpermute(y, token_rows, token_offsets, probs, acc)
