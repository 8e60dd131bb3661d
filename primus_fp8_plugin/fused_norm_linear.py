"""Norm followed by an FP8 blockwise linear, with the norm's output quantized straight to FP8.

Forward:  x --norm + quantize (one kernel after the row statistics; the bf16 norm output is never
          written)--> rowwise FP8 copy -> Y = norm(x) W^T (+ b); columnwise copy kept for wgrad.
Saved:    x (the residual stream, which the model keeps anyway), gamma, the row statistics (fp32 [M]),
          the columnwise FP8 copy of norm(x), the cached quantized weight.
Backward: as ``linear.py`` for dY (dgrad, wgrad into ``weight.grad`` or ``main_grad``, bias
          gradient), then the norm's backward on dgrad's output.

Bit for bit ``normalization.norm`` followed by ``fp8_blockwise_linear`` (outputs and every gradient):
the same quantized bits reach the same GEMMs, and the norm's backward gets the same inputs.
"""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .linear import _check_inputs, keep_weight, weight_gradient
from .normalization import check_norm_inputs, norm_gamma
from .recipe import BlockwiseRecipe, TensorRole
from .tensor import BlockwiseFp8Tensor
from .weight_cache import WeightCache


def quantized_weight(weight, recipe, backend, cache, refresh) -> BlockwiseFp8Tensor:
    """W and W^T, from the cache when given (as ``linear.py`` gets them)."""
    p_w = recipe.params(TensorRole.WEIGHT)
    if cache is not None:
        return cache.get(weight, p_w, backend, refresh=refresh)
    with torch.no_grad():
        return backend.quantize_weight(weight.detach().contiguous(), p_w)


def linear_backward(ctx, dy2d, need_dinput: bool, input_dtype, x_col, x_col_scale, weight):
    """dY's quantization, dgrad (if ``need_dinput``), wgrad and the bias gradient of a fused op's
    linear: ``(d_input [M, K] or None, dW, db)``. ``x_col``/``x_col_scale``: the input's saved
    columnwise copy; ``ctx`` holds ``wq``, ``recipe``, ``backend``, ``has_bias``, ``x_meta``,
    ``need_dw`` and ``need_db``."""
    backend: Backend = ctx.backend
    need_dw, need_db = ctx.need_dw, ctx.need_db
    dyq = backend.quantize_act(dy2d, ctx.recipe.params(TensorRole.GRAD_OUTPUT), rowwise=need_dinput, columnwise=need_dw)
    d_input = backend.gemm_dgrad(dyq, ctx.wq, input_dtype) if need_dinput else None
    dw = None
    if need_dw:
        (m, k), fp8 = ctx.x_meta
        xq = BlockwiseFp8Tensor((m, k), 1, fp8, input_dtype, columnwise_data=x_col, columnwise_scale_inv=x_col_scale)
        dw = weight_gradient(backend, dyq, xq, weight)
    db = dy2d.sum(0) if (ctx.has_bias and need_db) else None
    ctx.wq = None
    return d_input, dw, db


def save_linear(ctx, xq: BlockwiseFp8Tensor, wq, bias, recipe, backend) -> tuple:
    """Keep what ``linear_backward`` reads on ``ctx``; returns the tensors to add to ``save_for_backward``
    (the columnwise copy, None without one, as linear.py saves it)."""
    ctx.x_meta = (tuple(xq.shape), xq.fp8_dtype)
    ctx.wq, ctx.recipe, ctx.backend, ctx.has_bias = wq, recipe, backend, bias is not None
    return xq.columnwise_data, xq.columnwise_scale_inv


class _Fp8NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, weight, bias, normalization, eps, recipe, backend, cache, refresh):
        h, n = x.shape[-1], weight.shape[0]
        lead = x.shape[:-1]
        x2d = x.reshape(-1, h)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        xq, mean, rstd = backend.quantize_norm_act(x2d, gamma, beta, eps, normalization, recipe.params(TensorRole.INPUT),
                                                   rowwise=True, columnwise=weight.requires_grad)  # fmt: skip
        wq = quantized_weight(weight, recipe, backend, cache, refresh)
        y = backend.gemm_fwd(xq, wq, bias, x.dtype)
        ctx.save_for_backward(x2d, gamma, mean, rstd, *save_linear(ctx, xq, wq, bias, recipe, backend))
        keep_weight(ctx, weight)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        x2d, gamma, mean, rstd, x_col, x_col_scale = ctx.saved_tensors
        weight = ctx.weight
        need_dx, need_dgamma, need_dbeta, ctx.need_dw, ctx.need_db = ctx.needs_input_grad[:5]
        need_dnormed = need_dx or need_dgamma or need_dbeta
        dy2d = dy.reshape(-1, dy.shape[-1])
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        dnormed, dw, db = linear_backward(ctx, dy2d, need_dnormed, ctx.x_dtype, x_col, x_col_scale, weight)
        dx = dgamma = dbeta = None
        if need_dnormed:
            dx, dgamma, dbeta = ctx.backend.norm_bwd(dnormed, x2d, gamma, mean, rstd, need_dgamma=need_dgamma,
                                                     need_dbeta=need_dbeta)  # fmt: skip
            dx = dx.view(ctx.x_shape) if need_dx else None
        return dx, dgamma, dbeta, dw, db, None, None, None, None, None, None


def fp8_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    normalization: str = "LayerNorm",
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: WeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``norm(x) W^T + b`` with the norm's output quantized to FP8 directly (differentiable).

    Args:
        x: ``[..., in_features]`` bf16/fp16/fp32, any M (rows need not be a multiple of 128).
        norm_weight, norm_bias: the norm's ``[in_features]`` gamma and beta (beta: LayerNorm only,
            or None); ``zero_centered_gamma`` scales by ``norm_weight + 1``.
        weight, bias, recipe, weight_cache, refresh_weight_cache: as for ``fp8_blockwise_linear``
            (a ``weight.main_grad`` gets the weight gradient accumulated in fp32).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``; ``eps`` as for ``normalization.norm``.
        backend: ``reference``, ``triton`` (or one built on it), ``"auto"`` or a ``Backend``.

    Returns:
        ``[..., out_features]`` in x's dtype: the same bits as
        ``fp8_blockwise_linear(norm(x, ...), weight, bias)``, and the same gradients.
    """
    _check_inputs(x, weight, bias)
    check_norm_inputs(x, normalization, norm_weight, norm_bias)
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    gamma = norm_gamma(norm_weight, zero_centered_gamma)
    return _Fp8NormLinearFn.apply(x, gamma, norm_bias, weight, bias, normalization, float(eps), recipe or BlockwiseRecipe(),
                                  impl, weight_cache, refresh_weight_cache)  # fmt: skip
