"""SwiGLU followed by an FP8 blockwise linear (an MLP's fc2), with the activation quantized straight
to FP8.

Forward:  h = fc1's output [..., 2F] --SwiGLU + quantize (one kernel; the activation is never
          written)--> rowwise FP8 copy -> Y = swiglu(h) W^T (+ b); columnwise copy kept for wgrad.
Saved:    h (as the unfused SwiGLU saves it), the columnwise FP8 copy, the cached quantized weight.
Backward: as ``linear.py`` for dY, then SwiGLU's backward recomputed from h on dgrad's output.

Bit for bit ``swiglu.swiglu`` followed by ``fp8_blockwise_linear`` (outputs and every gradient).
"""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .fused_norm_linear import linear_backward, quantized_weight, save_linear
from .linear import _check_inputs, keep_weight
from .recipe import BlockwiseRecipe, TensorRole
from .swiglu import check_swiglu_input
from .weight_cache import WeightCache


class _Fp8SwigluLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, recipe, backend, cache, refresh):
        n = weight.shape[0]
        lead = h.shape[:-1]
        h2d = h.reshape(-1, h.shape[-1])
        if not h2d.is_contiguous():
            h2d = h2d.contiguous()
        xq = backend.quantize_swiglu_act(h2d, recipe.params(TensorRole.INPUT), rowwise=True, columnwise=weight.requires_grad)
        wq = quantized_weight(weight, recipe, backend, cache, refresh)
        y = backend.gemm_fwd(xq, wq, bias, h.dtype)
        ctx.save_for_backward(h2d, *save_linear(ctx, xq, wq, bias, recipe, backend))
        keep_weight(ctx, weight)
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        return y.view(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        h2d, x_col, x_col_scale = ctx.saved_tensors
        weight = ctx.weight
        need_dh, ctx.need_dw, ctx.need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        dact, dw, db = linear_backward(ctx, dy2d, need_dh, ctx.h_dtype, x_col, x_col_scale, weight)
        dh = ctx.backend.swiglu_bwd(dact, h2d).view(ctx.h_shape) if need_dh else None
        return dh, dw, db, None, None, None, None


def fp8_swiglu_linear(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: WeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``swiglu(h) W^T + b`` with the SwiGLU output quantized to FP8 directly (differentiable).

    Args:
        h: fc1's output ``[..., 2 * in_features]`` = ``[gate | up]`` (Megatron's gated layout),
            bf16/fp16/fp32, any M.
        weight: ``[out_features, in_features]``; bias, recipe, backend, weight_cache,
            refresh_weight_cache as for ``fp8_blockwise_linear``.

    Returns:
        ``[..., out_features]`` in h's dtype: the same bits as
        ``fp8_blockwise_linear(swiglu(h), weight, bias)``, and the same gradients.
    """
    check_swiglu_input(h)
    if h.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"h's last dim is {h.shape[-1]} but the weight takes {weight.shape[-1]} features (need 2x)")
    _check_inputs(h[..., : weight.shape[-1]], weight, bias)
    impl = backend if isinstance(backend, Backend) else get_backend(backend, h.device)
    return _Fp8SwigluLinearFn.apply(h, weight, bias, recipe or BlockwiseRecipe(), impl, weight_cache, refresh_weight_cache)
