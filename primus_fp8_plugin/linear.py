"""The autograd op of an FP8 blockwise linear layer: what is quantized when, and what is saved.

Forward:  X --quantize (rowwise for the GEMM, columnwise kept for wgrad)--> Y = X W^T (+ b)
          W --weight cache (W and W^T, once per weight version)
Saved:    the columnwise FP8 copy of X and its scales (about 0.52x the bytes of a bf16 X), and the
          cached quantized weight. The high-precision X only where another node saves its storage
          anyway (``mark_saved_elsewhere``: the attention output feeding the output projection); the
          columnwise copy is then quantized from it in backward, the same bits, and no byte is added.
Backward: dY --quantize (rowwise + columnwise; E5M2 under HYBRID)--> dX = dY W   (W^T copy)
          dW = dY^T X (columnwise copies), or main_grad += dW in fp32 (Megatron's gradient-
          accumulation fusion) when the weight has a ``main_grad``; db = sum of dY over rows.
          Only what is needed is quantized and computed: a frozen weight skips X's columnwise copy
          and wgrad; with neither dX nor dW needed (bias-only training), dY is not quantized.
          ``backward(retain_graph=True)`` keeps the quantized weight for the next backward.

Inside ``torch.compile`` the op runs eagerly between compiled graphs (the backend's kernels, bit
for bit, and the weight cache's checks on every call). ``in_features == 0`` or ``out_features == 0``
is computed exactly without FP8 (y = bias, or an empty output).
"""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .recipe import BlockwiseRecipe, TensorRole
from .tensor import HIGH_PRECISION_DTYPES, BlockwiseFp8Tensor
from .weight_cache import WeightCache


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"input and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"input has dtype {x.dtype}; FP8 blockwise linear takes bfloat16, float16 or float32")
    if weight.dtype not in HIGH_PRECISION_DTYPES:
        fix = (
            "use torch.nn.Linear for complex weights" if weight.dtype.is_complex else "convert it, e.g. layer.to(torch.bfloat16)"
        )
        raise TypeError(
            f"weight has dtype {weight.dtype}; FP8 blockwise linear takes bfloat16, float16 or float32 weights: {fix}"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dim is {x.shape[-1] if x.dim() else None} but in_features is {weight.shape[1]}")
    if x.device != weight.device:
        raise ValueError(f"input is on {x.device} but the weight is on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.device != weight.device:
            raise ValueError(f"bias must be [{weight.shape[0]}] on {weight.device}, got {tuple(bias.shape)} on {bias.device}")
        if bias.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"bias has dtype {bias.dtype}; FP8 blockwise linear takes bfloat16, float16 or float32 biases")


SAVED_ELSEWHERE = "_primus_fp8_saved_elsewhere"


def mark_saved_elsewhere(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a view into storage another autograd node already saves for its backward (SDPA saves its
    output; ``t`` is that output reshaped for the output projection). An FP8 linear whose input is ``t`` (the
    same tensor object, contiguous, weight gradient wanted) then saves ``t`` itself, which holds no new bytes,
    instead of its columnwise FP8 copy (0.52x a bf16 ``t``), and quantizes that copy from ``t`` in backward:
    the same bits, one more read of ``t``. Returns ``t``. The caller vouches for the sharing; a tensor that
    replaces ``t`` (activation offloading, a copy) carries no mark, and its linear saves the FP8 copy."""
    setattr(t, SAVED_ELSEWHERE, True)
    return t


def weight_gradient(backend: Backend, dyq: BlockwiseFp8Tensor, xq: BlockwiseFp8Tensor, weight: torch.Tensor):
    """The weight's gradient from the columnwise copies of dY and X: ``dW = dY^T X`` in the weight's
    dtype, or, when the weight has a ``main_grad`` (Megatron), accumulated into it in fp32 and what
    autograd should get returned (see ``_accumulate_into_main_grad``)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not getattr(weight, "fuse_wgrad_accumulation", True):
        return backend.gemm_wgrad(dyq, xq, weight.dtype, None)
    return _accumulate_into_main_grad(backend, dyq, xq, weight, main_grad)


class _Fp8BlockwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, backend, cache, refresh_cache, input_saved_elsewhere=False):
        k, n = weight.shape[1], weight.shape[0]
        lead = x.shape[:-1]
        x2d = x.reshape(-1, k)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        need_wgrad = weight.requires_grad
        keep_x = need_wgrad and input_saved_elsewhere and x.is_contiguous()  # x2d is then a view of x
        xq = backend.quantize_act(x2d, recipe.params(TensorRole.INPUT), rowwise=True, columnwise=need_wgrad and not keep_x)
        p_w = recipe.params(TensorRole.WEIGHT)
        if cache is not None:
            wq = cache.get(weight, p_w, backend, refresh=refresh_cache)
        else:
            with torch.no_grad():
                wq = backend.quantize_weight(weight.detach().contiguous(), p_w)
        y = backend.gemm_fwd(xq, wq, bias, x.dtype)

        if keep_x:  # X's storage stays alive for another node's backward: keep X, quantize it again there
            ctx.save_for_backward(x2d, None)
        elif need_wgrad:  # keep only what wgrad reads: X's columnwise copy
            ctx.save_for_backward(xq.columnwise_data, xq.columnwise_scale_inv)
        else:
            ctx.save_for_backward(None, None)
        ctx.requantize_x = keep_x
        keep_weight(ctx, weight)
        ctx.x_meta = (tuple(xq.shape), xq.fp8_dtype, x.dtype, lead)
        ctx.wq = wq  # owned by the weight cache (or by this call); weight-sized, not activation-sized
        ctx.recipe, ctx.backend = recipe, backend
        ctx.has_bias = bias is not None
        return y.view(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        x_col, x_col_scale = ctx.saved_tensors
        weight = ctx.weight
        (m, k), x_fp8, x_dtype, lead = ctx.x_meta
        n = weight.shape[0]
        backend: Backend = ctx.backend
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dy2d = dy.reshape(-1, n)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        dyq = None
        if need_dx or need_dw:  # bias-only training (a frozen weight, no input gradient) needs no FP8 dY
            dyq = backend.quantize_act(dy2d, ctx.recipe.params(TensorRole.GRAD_OUTPUT), rowwise=need_dx, columnwise=need_dw)

        dx = backend.gemm_dgrad(dyq, ctx.wq, x_dtype).view(*lead, k) if need_dx else None
        dw = None
        if need_dw:
            if ctx.requantize_x:  # x_col is X itself [m, k]: the columnwise copy forward did not keep
                # forward's own call (both copies; the rowwise one is dropped): the same kernel, so the same bits
                xq = backend.quantize_act(x_col, ctx.recipe.params(TensorRole.INPUT), rowwise=True, columnwise=True)
            else:
                xq = BlockwiseFp8Tensor((m, k), 1, x_fp8, x_dtype, columnwise_data=x_col, columnwise_scale_inv=x_col_scale)
            dw = weight_gradient(backend, dyq, xq, weight)
        # TE's own bias gradient under Float8BlockScaling (unfused): a sum in dY's dtype, which torch
        # accumulates in fp32 and rounds once, without an fp32 copy of dY.
        db = dy2d.sum(0) if (ctx.has_bias and need_db) else None
        if not _keeps_graph():
            ctx.wq = None  # the graph is freed after this backward: so is the quantized weight
        return dx, dw, db, None, None, None, None, None


def keep_weight(ctx, weight: torch.Tensor) -> None:
    """Keep the weight itself for backward on ``ctx`` (read there for its shape, dtype and ``main_grad``), not
    through ``save_for_backward``: under ``torch.autograd.graph.saved_tensors_hooks`` (memory tools, activation
    offloading, ``save_on_cpu``) backward would get a new tensor object without the parameter's Python
    attributes, and Megatron's ``main_grad`` accumulation would be silently skipped (the gradient then lands
    in ``.grad``). The weight is an input of the op, so this holds no reference cycle; its data are never read
    in backward (the quantized copies are)."""
    ctx.weight = weight


def _keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``), so it may run again
    (True where torch cannot say: the quantized weight is then freed with the graph)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def _accumulate_into_main_grad(backend: Backend, dyq, xq, weight: torch.Tensor, main_grad: torch.Tensor):
    """Megatron's gradient-accumulation fusion: ``main_grad += dY^T X`` in fp32. Returns what autograd
    gets as the weight's gradient: under Megatron's protocol (the weight has a
    ``grad_added_to_main_grad`` attribute, which Megatron's DDP sets and whose backward hook discards
    ``weight.grad``) a dummy tensor, so that the parameter's hooks run (zeros if the weight asks for
    ``zero_out_wgrad``, else uninitialised, as TE does); otherwise None, so that ``weight.grad``
    stays None and the gradient is only in ``main_grad``."""
    if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape or not main_grad.is_contiguous():
        raise ValueError(
            f"weight.main_grad must be a contiguous float32 tensor of the weight's shape {tuple(weight.shape)}, "
            f"got {main_grad.dtype} {tuple(main_grad.shape)} (contiguous={main_grad.is_contiguous()}); "
            "set weight.fuse_wgrad_accumulation = False to get the gradient in weight.grad instead"
        )
    backend.gemm_wgrad(dyq, xq, torch.float32, main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def fp8_blockwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: WeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``y = x W^T + b`` with FP8 blockwise GEMMs in forward and backward (differentiable).

    Args:
        x: ``[..., in_features]``, bfloat16/float16/float32; any number of leading dims, any M.
        weight: ``[out_features, in_features]``, bfloat16/float16/float32, any strides. If it has a
            ``main_grad`` (fp32, contiguous, its shape) and ``fuse_wgrad_accumulation`` is not False,
            the weight gradient is accumulated into ``main_grad`` in fp32; autograd then gets a dummy
            gradient if the weight has Megatron's ``grad_added_to_main_grad`` attribute (set to True),
            else None (``weight.grad`` stays None). An inference tensor (made under
            ``torch.inference_mode()``) works under ``no_grad``/``inference_mode``, not in autograd.
        bias: ``[out_features]`` or None.
        recipe: numerics (default ``BlockwiseRecipe()``: TE's Float8BlockScaling defaults).
        backend: a backend name, ``"auto"``, or a ``Backend``.
        weight_cache: reuse the weight's quantized copies while the weight is unchanged
            (see ``weight_cache.py``); None quantizes the weight on every call.
        refresh_weight_cache: force the cache to re-quantize (first microbatch of a step).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        TypeError: an input, weight or bias dtype other than bfloat16, float16 or float32.
        ValueError: mismatched shapes or devices.
        RuntimeError: an inference-tensor weight in a forward that autograd records.
    """
    _check_inputs(x, weight, bias)
    if torch.compiler.is_compiling():
        return _outside_compiled_graphs(x, weight, bias, recipe, backend, weight_cache, refresh_weight_cache)
    return _linear(x, weight, bias, recipe, backend, weight_cache, refresh_weight_cache)


def _linear(x, weight, bias, recipe, backend, weight_cache, refresh_weight_cache):
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        # nothing to quantize: y = bias (K = 0) or an empty [..., 0] output (N = 0), exactly
        b = None if bias is None else bias.to(x.dtype)
        return torch.nn.functional.linear(x, weight.to(x.dtype), b)
    if weight.is_inference() and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        if x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad):
            raise RuntimeError(
                "the weight is an inference tensor (made or loaded under torch.inference_mode()), which autograd "
                "cannot save for backward: build or load the layer outside inference_mode to train it, or run "
                "this forward under torch.no_grad() or torch.inference_mode()"
            )
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    shared = bool(getattr(x, SAVED_ELSEWHERE, False))
    return _Fp8BlockwiseLinearFn.apply(x, weight, bias, recipe or BlockwiseRecipe(), impl, weight_cache, refresh_weight_cache,
                                       shared)  # fmt: skip


@torch.compiler.disable
def _outside_compiled_graphs(*args):
    """The FP8 linear inside a ``torch.compile``d model: run eagerly between compiled graphs, so that its
    numerics are the backend's own kernels' (bit for bit, not a traced re-implementation) and the
    weight cache checks its key on every call (a traced check would be frozen into the graph)."""
    return _linear(*args)
