"""THE FP8 blockwise linear: one autograd op for every FP8 linear of the package.

An input stage (``stages.py``: plain, norm, SwiGLU) hands the core the quantized X; a token exchange
(``exchange.py``: local, sequence-parallel) moves its rows; a layout (``layouts.py``: one weight, or grouped
experts) picks the backend's operations. What the core does, written once:

Forward:  X --(stage: quantize; rowwise for the GEMM, columnwise kept for wgrad)--> (exchange: gather rows)
          W --the weight source: a weight cache (W and W^T once per weight version; or W only), the FP8 primary
            weight a cache holds (``fp8_params.py``), or quantized for this call
          Y = X W^T (+ b)
Saved:    X's columnwise FP8 copy (about 0.52x the bytes of a bf16 X) and what the stage's backward reads; the
          quantized weight on ``ctx`` (weight-sized, owned by the cache). Never a high-precision X unless another
          node saves its storage anyway (``stages.Plain(keep_input=True)``).
Backward: dY --quantize (rowwise + columnwise; E5M2 under HYBRID)--> dX = dY W (the source's W^T, or the exact
          transpose of W's blocks made for this dgrad and freed after it; exchange: reduce-scatter)
          dW = dY^T X, or ``main_grad += dW`` in fp32 wherever the weights have one (``weight_gradients``)
          db = sum of dY over rows; then the stage's own backward on dX.
          Only what is needed is quantized and computed: a frozen weight skips X's columnwise copy and wgrad; with
          neither dX nor dW needed (bias-only training) dY is not quantized.
          ``backward(retain_graph=True)``: the quantized weight is kept for the next backward, else released.

The weights are kept on ``ctx`` (not ``save_for_backward``): under saved-tensor hooks (activation offloading,
``save_on_cpu``) backward would get new tensor objects without the parameters' ``main_grad``, and the gradient
would silently land in ``.grad``. They are inputs of the op, so this holds no reference cycle; their data are never
read in backward (the quantized copies are).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import NamedTuple

import torch

from ..backends import Backend
from ..recipe import BlockwiseRecipe, TensorRole


class LinearPlan(NamedTuple):
    """Everything but the tensors of one FP8 linear call.

    ``stage``, ``exchange``, ``layout``: the three parts above. ``cache``: a ``WeightCache`` (dense) or
    ``GroupedWeightCache`` (grouped), or None to quantize the weights on every call; ``refresh`` re-quantizes
    through the cache (Megatron's first microbatch). ``need_wgrad``: grad mode is on and a weight requires grad
    (decided before the op runs, where grad mode is still visible).
    """

    stage: object
    exchange: object
    layout: object
    recipe: BlockwiseRecipe
    backend: Backend
    cache: object
    refresh: bool
    num_weights: int
    has_bias: bool
    need_wgrad: bool


class _Fp8LinearFn(torch.autograd.Function):
    """Inputs: the plan, then the stage's inputs, the weights, the biases (if any)."""

    @staticmethod
    def forward(ctx, plan: LinearPlan, *tensors):
        stage, exchange, layout, backend, recipe = plan.stage, plan.exchange, plan.layout, plan.backend, plan.recipe
        ns, nw = stage.num_inputs, plan.num_weights
        inputs, weights, biases = tensors[:ns], tensors[ns : ns + nw], tensors[ns + nw :]
        ctx.plan, ctx.weights = plan, weights
        if inputs[0].numel() == 0:  # no rows: nothing to quantize; every gradient is zero (``_zero_rows_backward``)
            ctx.meta = None
            ctx.leaves = [None if t is None else (t.shape, t.dtype, t.device) for t in (*inputs, *biases)]
            return inputs[0].new_empty(*exchange.gathered_shape(inputs[0].shape[:-1]), layout.out_features(weights))
        requantize = stage.requantizes(inputs, plan.need_wgrad)
        p_in = recipe.params(TensorRole.INPUT)
        xq, stage_saved, in_shape = stage.forward(backend, layout, p_in, inputs, columnwise=plan.need_wgrad and not requantize,
                                                  requantize=requantize)  # fmt: skip
        wq = layout.quantize_weights(backend, weights, recipe.params(TensorRole.WEIGHT), plan.cache, plan.refresh)
        out_dtype = inputs[0].dtype
        y = layout.gemm_fwd(backend, exchange.gather_rowwise(xq), wq, biases, out_dtype)

        x_col = (xq.columnwise_data, xq.columnwise_scale_inv) if plan.need_wgrad and not requantize else (None, None)
        ctx.save_for_backward(*x_col, *stage_saved)
        ctx.wq = wq
        ctx.meta = (tuple(xq.shape), xq.fp8_dtype, out_dtype, in_shape, requantize)
        n = layout.out_features(weights)
        return y.view(*exchange.gathered_shape(in_shape[:-1]), n)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_autocast_enabled(dy.device.type):  # a backward run inside an autocast region
            with torch.autocast(dy.device.type, enabled=False):
                return _backward(ctx, dy)
        return _backward(ctx, dy)


def _backward(ctx, dy):
    plan: LinearPlan = ctx.plan
    if ctx.meta is None:
        return _zero_rows_backward(ctx)
    stage, exchange, layout, backend, recipe = plan.stage, plan.exchange, plan.layout, plan.backend, plan.recipe
    (m, k), x_fp8, x_dtype, in_shape, requantize = ctx.meta
    x_col, x_col_scale, *stage_saved = ctx.saved_tensors
    weights = ctx.weights
    ns, nw = stage.num_inputs, plan.num_weights
    needs = ctx.needs_input_grad[1:]
    need_stage, need_w, need_b = needs[:ns], needs[ns : ns + nw], needs[ns + nw :]
    need_dx, need_dw = any(need_stage), plan.need_wgrad and any(need_w)
    n = layout.out_features(weights)
    dy2d = dy.reshape(-1, n)
    if not dy2d.is_contiguous():
        dy2d = dy2d.contiguous()

    dyq = None
    if need_dx or need_dw:  # bias-only training needs no FP8 dY
        dyq = layout.quantize_grad(backend, dy2d, recipe.params(TensorRole.GRAD_OUTPUT), rowwise=need_dx, columnwise=need_dw)
    started = exchange.start_gather_columnwise(x_col, x_col_scale) if need_dw and not requantize else None
    dx2d, rs_work = None, None
    if need_dx:  # W^T: the weight source's, or made now from W's blocks (a weight held as W only) and freed after
        dx2d, rs_work = exchange.reduce_scatter(layout.gemm_dgrad(backend, dyq, layout.with_transpose(backend, ctx.wq), x_dtype))
    dws = [None] * nw
    if need_dw:
        if requantize:
            xq = stage.columnwise_again(backend, layout, recipe.params(TensorRole.INPUT), stage_saved)
        else:
            data, scale = exchange.finish_gather_columnwise(started)
            xq = layout.columnwise((exchange.world * m, k), x_fp8, x_dtype, data, scale)
        dws = weight_gradients(layout, backend, dyq, xq, weights, need_w)
    dbs = layout.bias_grads(dy2d) if any(need_b) else [None] * len(need_b)
    if rs_work is not None:
        rs_work.wait()
    d_stage = stage.backward(backend, dx2d, stage_saved, in_shape, need_stage)
    if not keeps_graph():
        ctx.wq = None  # the graph is freed after this backward: so is the quantized weight
    return None, *d_stage, *dws, *[d if nb else None for d, nb in zip(dbs, need_b)]


def _zero_rows_backward(ctx) -> tuple:
    """Gradients of an op on zero rows: zeros for every input that needs one (nothing added to a ``main_grad``)."""
    plan: LinearPlan = ctx.plan
    ns = plan.stage.num_inputs
    needs = ctx.needs_input_grad[1:]
    metas = ctx.leaves[:ns] + [(w.shape, w.dtype, w.device) for w in ctx.weights] + ctx.leaves[ns:]
    grads = [torch.zeros(m[0], dtype=m[1], device=m[2]) if m is not None and need else None for m, need in zip(metas, needs)]
    nw = len(ctx.weights)
    if plan.need_wgrad and any(needs[ns : ns + nw]) and main_grads_to_fill(ctx.weights) is not None:
        grads[ns : ns + nw] = placeholder_gradients(ctx.weights)
    return None, *grads


def keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``), so it may run again (True where torch
    cannot say: the quantized weight is then freed with the graph)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


# ---- the weight gradient: into .grad, or into main_grad under Megatron's protocol ------------------------------
# Every pass over the weights below is a C-level ``map`` (no Python call per expert): the host work of a grouped
# op does not grow with its number of experts (tests/test_grouped_host_work.py).

_MAIN_GRAD, _FUSE, _ADDED = repeat("main_grad"), repeat("fuse_wgrad_accumulation"), repeat("grad_added_to_main_grad")
_dtype_of = operator.attrgetter("dtype")


def main_grads_to_fill(weights) -> list | None:
    """The weights' ``main_grad`` tensors where the op accumulates ``dW`` into them, else None (``dW`` goes to
    autograd, in the weight's dtype).

    The op fills ``main_grad`` (fp32, inside the wgrad GEMM) wherever every weight has one, whatever Megatron's
    ``gradient_accumulation_fusion`` says, unless a weight says ``fuse_wgrad_accumulation = False`` (the opt-out:
    the layers' ``fuse_wgrad_accumulation`` keyword). Under Megatron's protocol (``grad_added_to_main_grad``: its
    hook adds ``.grad`` into ``main_grad``) gradient buffers of another dtype than fp32 (no
    ``grad_reduce_in_fp32``) get ``dW`` through ``.grad`` too, as Megatron's own unfused layers give it: the kernels
    accumulate in fp32 only. Any other ``main_grad`` that is not a contiguous fp32 tensor of the weight's shape is
    refused. Weights of one op either all have one or none has."""
    main_grads = list(map(getattr, weights, _MAIN_GRAD, repeat(None)))
    missing = sum(map(operator.is_, main_grads, repeat(None)))
    if missing == len(weights) or False in set(map(getattr, weights, _FUSE, repeat(True))):
        return None
    if missing:
        raise ValueError("either every expert weight has a main_grad or none has")
    if set(map(_dtype_of, main_grads)) != {torch.float32} and set(map(hasattr, weights, _ADDED)) == {True}:
        return None
    check_main_grads(weights, main_grads)
    return main_grads


def weight_gradients(layout, backend: Backend, dyq, xq, weights, need_w) -> list:
    """What autograd gets for each weight: ``dW = dY^T X`` in the weight's dtype (None where not needed); or, where
    ``main_grads_to_fill`` gives the ``main_grad`` tensors, ``main_grad += dW`` in fp32 inside the wgrad GEMM and
    ``placeholder_gradients`` for autograd."""
    main_grads = main_grads_to_fill(weights)
    if main_grads is None:
        dws = layout.gemm_wgrad(backend, dyq, xq, weights[0].dtype, None)
        return [d if nd else None for d, nd in zip(dws, need_w)]
    layout.gemm_wgrad(backend, dyq, xq, torch.float32, main_grads)
    return placeholder_gradients(weights)


def check_main_grads(weights, main_grads) -> None:
    """Every ``main_grad`` a contiguous fp32 tensor of its weight's shape (C-level passes; the loop runs only to
    name the first wrong one)."""
    shapes_ok = list(map(operator.attrgetter("shape"), main_grads)) == list(map(operator.attrgetter("shape"), weights))
    if shapes_ok and set(map(_dtype_of, main_grads)) == {torch.float32} and all(map(torch.Tensor.is_contiguous, main_grads)):
        return
    for i, (w, g) in enumerate(zip(weights, main_grads)):
        if g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous():
            which = "weight.main_grad" if len(weights) == 1 else f"weight {i}'s main_grad"
            raise ValueError(
                f"{which} must be a contiguous float32 tensor of the weight's shape {tuple(w.shape)}, got {g.dtype} "
                f"{tuple(g.shape)} (contiguous={g.is_contiguous()}); set fuse_wgrad_accumulation = False on the weight "
                "to get the gradient in .grad instead"
            )


_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def placeholder_gradients(weights) -> list:
    """What autograd gets for weights whose gradients went into their ``main_grad``.

    Under Megatron's protocol (the weights have a ``grad_added_to_main_grad`` attribute, which Megatron's DDP sets
    and whose hook then discards ``.grad`` instead of adding it): the attribute is set True and every weight gets a
    placeholder gradient, so that the parameters' hooks run. Uninitialised placeholders (as TE's) are aliases
    (``detach``) of one storage per shape, dtype and device, shared by all weights and calls: autograd takes a
    gradient nothing else refers to as ``.grad`` as it is, where it clones a shared tensor (a weight-sized copy per
    weight and backward); their values mean nothing and the hook discards them. Where a weight asks
    ``zero_out_wgrad`` (Megatron's hook then adds ``.grad``, which must be zeros), each weight gets zeros of its own,
    as Megatron's own layers give. Otherwise None: ``.grad`` stays None and the gradient is only in ``main_grad``."""
    marked = set(map(hasattr, weights, _ADDED))
    if marked == {False}:
        return [None] * len(weights)
    if marked != {True}:
        raise ValueError("either every expert weight follows Megatron's grad_added_to_main_grad protocol or none does")
    list(map(setattr, weights, _ADDED, repeat(True)))
    w0 = weights[0]
    if True in set(map(getattr, weights, repeat("zero_out_wgrad"), repeat(False))):
        return [torch.zeros(w.shape, dtype=w.dtype, device=w.device) for w in weights]
    key = (tuple(w0.shape), w0.dtype, w0.device)
    dummy = _PLACEHOLDERS.get(key)
    if dummy is None:
        dummy = torch.empty(w0.shape, dtype=w0.dtype, device=w0.device)
        _PLACEHOLDERS[key] = dummy
    return list(map(torch.Tensor.detach, repeat(dummy, len(weights))))


def apply_linear(plan: LinearPlan, inputs, weights, biases) -> torch.Tensor:
    """Run the core on ``inputs`` (the stage's), ``weights`` and ``biases`` (a list or None)."""
    device_type = inputs[0].device.type
    if torch.is_autocast_enabled(device_type):  # the op's dtypes are its inputs' (``api.py`` casts under autocast)
        with torch.autocast(device_type, enabled=False):
            return _Fp8LinearFn.apply(plan, *inputs, *weights, *(biases or ()))
    return _Fp8LinearFn.apply(plan, *inputs, *weights, *(biases or ()))
