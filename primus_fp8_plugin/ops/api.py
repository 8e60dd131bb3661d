"""The public FP8 linear ops: each is the one core (``core.py``) with an input stage, a token exchange and a layout.

=============================  =================  ============================================  ========
op                             stage              exchange                                      layout
=============================  =================  ============================================  ========
``fp8_blockwise_linear``       Plain              Local, or SequenceParallel(``sequence_parallel_group``)  Dense
``fp8_norm_linear``            Norm               Local, or SequenceParallel(``sequence_parallel_group``)  Dense
``fp8_swiglu_linear``          Swiglu             Local                                         Dense
``fp8_grouped_linear``         Plain              Local, or Permuted(a ``Routing``)             Grouped
``fp8_grouped_swiglu_linear``  Swiglu (weighted)  Local                                         Grouped
=============================  =================  ============================================  ========

What every op does the same way (written here once): inputs checked at the boundary; ``torch.autocast`` casts the
input to the autocast dtype (as ``F.linear`` under autocast) and the op runs in that dtype; inside ``torch.compile``
the op runs eagerly between compiled graphs (the backend's own kernels, bit for bit, and the weight cache's key
checked on every call); a weight with ``in_features == 0`` or ``out_features == 0`` is computed exactly without FP8;
an inference-tensor weight is refused in a forward that autograd records.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..backends import Backend, get_backend
from ..backends.reference_fused import ROW_WEIGHT_DTYPES, weight_rows
from ..grouped_tensor import GroupLayout, group_layout
from ..normalization import check_norm_inputs, norm, norm_gamma
from ..permutation import Routing
from ..recipe import BlockwiseRecipe, default_recipe
from ..swiglu import check_swiglu_input, swiglu
from . import checks
from .core import LinearPlan, apply_linear
from .exchange import Local, Permuted, SequenceParallel, fp8_gather_possible, gather_rows
from .layouts import Dense, Grouped
from .stages import Norm, Plain, Swiglu

SAVED_ELSEWHERE = "_primus_fp8_saved_elsewhere"
_requires_grad = operator.attrgetter("requires_grad")
_LOCAL, _DENSE, _PLAIN, _PLAIN_KEPT = Local(), Dense(), Plain(), Plain(keep_input=True)


def mark_saved_elsewhere(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a view into storage another autograd node already saves for its backward (SDPA saves its output;
    ``t`` is that output reshaped for the output projection). An FP8 linear whose input is ``t`` (the same tensor
    object, contiguous, weight gradient wanted) then saves ``t`` itself, which holds no new bytes, instead of its
    columnwise FP8 copy (0.52x a bf16 ``t``), and quantizes that copy from ``t`` in backward: the same bits, one more
    read of ``t``. Returns ``t``. The caller vouches for the sharing; a tensor that replaces ``t`` (activation
    offloading, a copy) carries no mark, and its linear saves the FP8 copy."""
    setattr(t, SAVED_ELSEWHERE, True)
    return t


def _autocast(x: torch.Tensor) -> torch.Tensor:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype != dtype and dtype in (torch.bfloat16, torch.float16):
            return x.to(dtype)
    return x


def eager_under_compile(op):
    """A public op that, inside ``torch.compile``, runs eagerly between compiled graphs: its numerics are the
    backend's own kernels' (bit for bit, not a traced re-implementation), and the weight cache checks its key on
    every call (a traced check would be frozen into the graph). Outside compilation the op is called directly."""
    eager = torch.compiler.disable(op)

    @functools.wraps(op)
    def call(*args, **kwargs):
        return eager(*args, **kwargs) if torch.compiler.is_compiling() else op(*args, **kwargs)

    return call


def _run(stage, exchange, layout, inputs, weights, biases, recipe, backend, cache, refresh) -> torch.Tensor:
    impl = backend if isinstance(backend, Backend) else get_backend(backend, inputs[0].device)
    need_wgrad = torch.is_grad_enabled() and any(map(_requires_grad, weights))
    plan = LinearPlan(stage, exchange, layout, recipe or default_recipe(), impl, cache, bool(refresh), len(weights),
                      biases is not None, need_wgrad)  # fmt: skip
    return apply_linear(plan, inputs, weights, biases)


def _exact(x_hp: torch.Tensor, weights, biases, layout) -> torch.Tensor:
    """``in_features == 0`` or ``out_features == 0``: nothing to quantize; ``y = bias`` or an empty output, exactly."""
    if not layout.grouped:
        b = None if biases is None else biases[0].to(x_hp.dtype)
        return torch.nn.functional.linear(x_hp, weights[0].to(x_hp.dtype), b)
    lead = x_hp.shape[:-1]
    rows = math.prod(lead)
    n = layout.out_features(weights)
    if biases is None or n == 0:
        y = x_hp.new_zeros(rows, n) + 0 * x_hp.sum()  # keeps the graph to x (its gradient is zero)
    else:
        per_row = torch.repeat_interleave(torch.arange(len(biases), device=x_hp.device), layout.layout.counts.long(),
                                          output_size=rows)  # fmt: skip
        y = torch.stack(list(biases)).to(x_hp.dtype)[per_row] + 0 * x_hp.sum()
    return y.view(*lead, n)


def _expert_weights(weights, in_features: int, device: torch.device, cached: bool) -> tuple[list, int, bool]:
    """The grouped ops' weights as the core takes them (``E`` tensors, or the one stacked ``[E, N, K]`` tensor in a
    list), the number of experts, and whether they are stacked; checked (each expert's only without a cache: a
    grouped weight cache checks them whenever it quantizes)."""
    if isinstance(weights, torch.Tensor):
        checks.check_stacked_weight(weights, in_features, device)
        return [weights], weights.shape[0], True
    weights = list(weights)
    checks.check_weights(weights, in_features, device, each=not cached)
    return weights, len(weights), False


def _exchange_for(group, x: torch.Tensor, need_wgrad: bool):
    """The sequence-parallel exchange, or None where the FP8 gather cannot give the bf16 way's bits (one rank needs
    nothing gathered; otherwise the caller gathers in bf16)."""
    if not dist.is_initialized():
        raise RuntimeError("sequence-parallel FP8 linears need torch.distributed initialised (the tensor-parallel group)")
    if x.dim() < 2:
        raise ValueError(f"x must be [s_local, ..., K] (the sequence outermost), got shape {tuple(x.shape)}")
    world = dist.get_world_size(group)
    rows = math.prod(x.shape[:-1])
    if rows and not fp8_gather_possible(rows, need_wgrad):
        return None
    return SequenceParallel(group, world)


@eager_under_compile
def fp8_blockwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sequence_parallel_group=None,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache=None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``y = x W^T + b`` with FP8 blockwise GEMMs in forward and backward (differentiable).

    Args:
        x: ``[..., in_features]``, bfloat16/float16/float32; any number of leading dims, any number of rows.
        weight: ``[out_features, in_features]``, bfloat16/float16/float32, any strides. With a ``main_grad`` (fp32,
            contiguous, its shape) and ``fuse_wgrad_accumulation`` not False, the weight gradient is accumulated into
            ``main_grad`` in fp32 (``core.main_grads_to_fill``). An inference tensor works under
            ``no_grad``/``inference_mode``, not in autograd.
        bias: ``[out_features]`` or None.
        sequence_parallel_group: a column-parallel layer's tensor-parallel group under sequence parallelism: ``x`` is
            this rank's shard ``[s_local, ..., in_features]`` (the sequence outermost), the output is
            ``[tp * s_local, ..., out_features]``, all-gathered in FP8 (``exchange.py``), the input's gradient
            reduce-scattered; the same bits as ``fp8_blockwise_linear(gather_rows(x, group), ...)``, which runs where
            the FP8 gather cannot give them (rows not a multiple of 128 with wgrad needed, an empty weight, an
            inference-tensor weight).
        recipe: numerics (default ``BlockwiseRecipe()``: TE's Float8BlockScaling defaults).
        backend: a backend name, ``"auto"``, or a ``Backend``.
        weight_cache: a ``WeightCache`` reusing the weight's quantized copies while it is unchanged; None quantizes
            the weight on every call. refresh_weight_cache: re-quantize through the cache (first microbatch).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype (the autocast dtype under ``torch.autocast``).

    Raises:
        TypeError: an input, weight or bias dtype other than bfloat16, float16 or float32.
        ValueError: mismatched shapes or devices, unequal sequence-parallel shards.
        RuntimeError: an inference-tensor weight in a forward that autograd records.
    """
    checks.check_input(x)
    checks.check_weights([weight], x.shape[-1], x.device)
    checks.check_biases(None if bias is None else [bias], 1, weight.shape[0], x.device)
    x = _autocast(x)
    biases = None if bias is None else [bias]
    fp8 = (recipe, backend, weight_cache, refresh_weight_cache)
    if sequence_parallel_group is not None:
        exchange = _exchange_for(sequence_parallel_group, x, torch.is_grad_enabled() and weight.requires_grad)
        if exchange is None or 0 in weight.shape or weight.is_inference():
            return fp8_blockwise_linear(gather_rows(x, sequence_parallel_group), weight, bias, recipe=recipe, backend=backend,
                                        weight_cache=weight_cache, refresh_weight_cache=refresh_weight_cache)  # fmt: skip
        exchange.check(x.shape, x.device)
    else:
        exchange = _LOCAL
    if 0 in weight.shape:
        return _exact(x, [weight], biases, _DENSE)
    checks.check_trainable_weights([x], [weight], biases)
    stage = _PLAIN_KEPT if getattr(x, SAVED_ELSEWHERE, False) and exchange is _LOCAL else _PLAIN
    return _run(stage, exchange, _DENSE, (x,), [weight], biases, *fp8)


@eager_under_compile
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
    sequence_parallel_group=None,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache=None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``norm(x) W^T + b`` with the norm's output quantized to FP8 in the norm's kernel (differentiable).

    Args:
        x: ``[..., in_features]`` bf16/fp16/fp32, any number of rows.
        norm_weight, norm_bias: the norm's ``[in_features]`` gamma and beta (beta: LayerNorm only, or None);
            ``zero_centered_gamma`` scales by ``norm_weight + 1``.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``; ``eps`` as for ``normalization.norm``.
        weight, bias, sequence_parallel_group, recipe, backend, weight_cache, refresh_weight_cache: as for
            ``fp8_blockwise_linear`` (under sequence parallelism the norm runs on this rank's shard; the
            gradients of ``norm_weight``/``norm_bias`` are this rank's tokens' part, which Megatron all-reduces).

    Returns:
        ``[..., out_features]`` in x's dtype: the same bits as ``fp8_blockwise_linear(norm(x, ...), weight, bias)``,
        and the same gradients.
    """
    checks.check_input(x)
    check_norm_inputs(x, normalization, norm_weight, norm_bias)
    checks.check_weights([weight], x.shape[-1], x.device)
    checks.check_biases(None if bias is None else [bias], 1, weight.shape[0], x.device)
    fp8 = (recipe, backend, weight_cache, refresh_weight_cache)
    x = _autocast(x)
    exchange = _LOCAL
    if sequence_parallel_group is not None:
        exchange = _exchange_for(sequence_parallel_group, x, torch.is_grad_enabled() and weight.requires_grad)
    if exchange is None or 0 in weight.shape or weight.is_inference() and exchange is not _LOCAL:
        normed = norm(x, normalization, norm_weight, norm_bias, eps, zero_centered_gamma, backend=backend)
        return fp8_blockwise_linear(normed, weight, bias, sequence_parallel_group=sequence_parallel_group, recipe=recipe,
                                    backend=backend, weight_cache=weight_cache,
                                    refresh_weight_cache=refresh_weight_cache)  # fmt: skip
    exchange.check(x.shape, x.device)
    gamma = norm_gamma(norm_weight, zero_centered_gamma)
    inputs = (x, gamma, norm_bias)
    checks.check_trainable_weights(inputs, [weight], None if bias is None else [bias])
    return _run(Norm(normalization, eps), exchange, _DENSE, inputs, [weight], None if bias is None else [bias], *fp8)


@eager_under_compile
def fp8_swiglu_linear(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache=None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``swiglu(h) W^T + b`` with the SwiGLU output quantized to FP8 in SwiGLU's kernel (differentiable).

    Args:
        h: fc1's output ``[..., 2 * in_features]`` = ``[gate | up]`` (Megatron's gated layout), bf16/fp16/fp32.
        weight ``[out_features, in_features]``, bias, recipe, backend, weight_cache, refresh_weight_cache: as for
            ``fp8_blockwise_linear``.

    Returns:
        ``[..., out_features]`` in h's dtype: the same bits as ``fp8_blockwise_linear(swiglu(h), weight, bias)``, and
        the same gradients.
    """
    checks.check_input(h)
    check_swiglu_input(h)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and h.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"h's last dim is {h.shape[-1]} but the weight takes {weight.shape[-1]} features (need 2x)")
    checks.check_weights([weight], h.shape[-1] // 2, h.device)
    checks.check_biases(None if bias is None else [bias], 1, weight.shape[0], h.device)
    h = _autocast(h)
    biases = None if bias is None else [bias]
    if 0 in weight.shape:
        return _exact(swiglu(h, backend=backend), [weight], biases, _DENSE)
    checks.check_trainable_weights([h], [weight], biases)
    return _run(Swiglu(), _LOCAL, _DENSE, (h,), [weight], biases, recipe, backend, weight_cache, refresh_weight_cache)


@eager_under_compile
def fp8_grouped_linear(
    x: torch.Tensor,
    m_splits: GroupLayout | torch.Tensor | Sequence[int] | Routing,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    biases: Sequence[torch.Tensor] | None = None,
    *,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache=None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``y_e = x_e W_e^T + b_e`` for each expert's tokens, with FP8 blockwise GEMMs forward and backward.

    Every result equals, bit for bit, the dense op on each expert's tokens with the same backend's kernels.

    Args:
        x: ``[..., in_features]`` bfloat16/float16/float32; the flattened rows are the permuted tokens (expert 0's
            first), or, with a ``Routing``, the tokens in token order.
        m_splits: tokens per expert: a list of ints, an integer tensor ``[E]`` on the tokens' device (checked without
            a host synchronisation on a GPU: ``grouped_tensor.group_layout``; the bias gradients read them on the
            host), or a ``GroupLayout``; or an MoE layer's ``permutation.Routing``: the rows are ``x[sorted_indices]``
            (``[N, out_features]`` returned, expert order), quantized straight from ``x`` without a permuted copy,
            and ``x``'s gradient sums each token's rows (``exchange.Permuted``): the bits of
            ``fp8_grouped_linear(x[routing.sorted_indices], routing.layout, ...)``.
        weights: ``E`` tensors ``[out_features, in_features]``, or one ``[E, out_features, in_features]`` tensor (the
            experts stacked: one autograd input with one gradient ``[E, out_features, in_features]``, so that autograd,
            Megatron's DDP hooks and the optimizer do their per-parameter work once, not ``E`` times; the same bits);
            with a ``main_grad`` on every one (Megatron), the weight gradients are accumulated into them in fp32
            (``core.main_grads_to_fill``).
        biases: ``E`` tensors ``[out_features]`` or None.
        recipe, backend, weight_cache, refresh_weight_cache: as for ``fp8_blockwise_linear`` (the cache is a
            ``GroupedWeightCache``).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.
    """
    checks.check_input(x)
    weights, experts, stacked = _expert_weights(weights, x.shape[-1], x.device, weight_cache is not None)
    biases = None if biases is None else list(biases)
    empty = 0 in weights[0].shape
    checks.check_biases(biases, experts, weights[0].shape[-2], x.device)
    x = _autocast(x)
    exchange = _LOCAL
    if isinstance(m_splits, Routing):
        backend = backend if isinstance(backend, Backend) else get_backend(backend, x.device)  # the backward's sum too
        exchange, rows = Permuted(m_splits, backend), m_splits.sorted_indices
        exchange.check(x.shape, x.device)
        if empty:  # computed exactly on the permuted rows (nothing to quantize)
            x, exchange, rows = x.reshape(m_splits.num_tokens, x.shape[-1]).index_select(0, rows), _LOCAL, None
        permuted_rows = m_splits.sorted_indices.numel()
        layout = _grouped_layout(x, m_splits.layout, experts, rows=permuted_rows).layout
        grouped = Grouped(layout, rows=rows, stacked=stacked)
    else:
        grouped = _grouped_layout(x, m_splits, experts, stacked=stacked)
    if empty:
        return _exact(x, weights, biases, grouped)
    checks.check_trainable_weights([x], weights, biases)
    return _run(_PLAIN, exchange, grouped, (x,), weights, biases, recipe, backend, weight_cache, refresh_weight_cache)


def _grouped_layout(x: torch.Tensor, m_splits, num_experts: int, rows: int | None = None, stacked: bool = False) -> Grouped:
    """The grouped layout of ``x``'s rows (or ``rows`` permuted rows) split as ``m_splits`` says (a ``GroupLayout``
    checked against them); ``stacked``: the weights are one ``[E, N, K]`` tensor."""
    rows = math.prod(x.shape[:-1]) if rows is None else rows
    if isinstance(m_splits, GroupLayout):
        layout = m_splits
        if layout.num_groups != num_experts or layout.num_tokens != rows or layout.device != x.device:
            raise ValueError(f"the layout describes {layout.num_groups} experts and {layout.num_tokens} tokens on "
                             f"{layout.device}; the layer has {num_experts} experts and the input {rows} tokens on "
                             f"{x.device}")  # fmt: skip
        return Grouped(layout, stacked=stacked)
    return Grouped(group_layout(m_splits, rows, x.device, num_groups=num_experts), stacked=stacked)


_SWIGLU, _WEIGHTED_SWIGLU = Swiglu(), Swiglu(weighted=True)


@eager_under_compile
def fp8_grouped_swiglu_linear(
    h: torch.Tensor,
    m_splits: GroupLayout | torch.Tensor | Sequence[int],
    weights: Sequence[torch.Tensor] | torch.Tensor,
    biases: Sequence[torch.Tensor] | None = None,
    *,
    probs: torch.Tensor | None = None,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache=None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``y_e = swiglu(h_e) W_e^T + b_e`` for each expert's tokens, SwiGLU of fc1's output quantized straight into
    the grouped FP8 layout (the activation is never written); each row of the activation times its ``probs`` entry
    where given (Megatron's grouped experts: ``act(fc1) * permuted_probs``, rounded to h's dtype).

    Args:
        h: fc1's output ``[..., 2 * in_features]`` = ``[gate | up]`` (Megatron's gated layout), bf16/fp16/fp32; the
            flattened rows are the permuted tokens (expert 0's first).
        m_splits, weights, biases, recipe, backend, weight_cache, refresh_weight_cache: as for
            ``fp8_grouped_linear``.
        probs: one weight per token (``h.shape[:-1]``), fp32, bf16 or fp16, or None; differentiable.

    Returns:
        ``[..., out_features]`` in h's dtype: the same bits as ``fp8_grouped_linear(a, ...)`` with ``a =
        swiglu(h)``, or ``a = (swiglu(h) * probs[..., None]).to(h.dtype)``, and the same gradients (h's and probs',
        as autograd gives them for that composition).
    """
    checks.check_input(h)
    check_swiglu_input(h)
    weights, experts, stacked = _expert_weights(weights, h.shape[-1] // 2, h.device, weight_cache is not None)
    biases = None if biases is None else list(biases)
    checks.check_biases(biases, experts, weights[0].shape[-2], h.device)
    if probs is not None:
        check_row_weights(probs, h)
    h = _autocast(h)
    grouped = _grouped_layout(h, m_splits, experts, stacked=stacked)
    if 0 in weights[0].shape:
        act = swiglu(h, backend=backend)
        return _exact(act if probs is None else weighted(act, probs), weights, biases, grouped)
    inputs = (h,) if probs is None else (h, probs)
    checks.check_trainable_weights(inputs, weights, biases)
    stage = _SWIGLU if probs is None else _WEIGHTED_SWIGLU
    return _run(stage, _LOCAL, grouped, inputs, weights, biases, recipe, backend, weight_cache, refresh_weight_cache)


def check_row_weights(probs, h: torch.Tensor) -> None:
    """``probs``: one fp32/bf16/fp16 weight per row of ``h [..., 2K]``, on h's device."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a tensor, got {type(probs).__name__}")
    if probs.dtype not in ROW_WEIGHT_DTYPES:
        raise TypeError(f"probs has dtype {probs.dtype}; it takes {', '.join(map(str, ROW_WEIGHT_DTYPES))}")
    if probs.numel() != math.prod(h.shape[:-1]) or probs.device != h.device:
        raise ValueError(f"probs must hold one weight per token of h {tuple(h.shape[:-1])} on {h.device}, got "
                         f"{tuple(probs.shape)} on {probs.device}")  # fmt: skip


def weighted(act: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``act [..., F]`` scaled per row by ``probs`` (differentiable; ``reference_fused.weight_rows``'s bits)."""
    rows = act.reshape(-1, act.shape[-1])
    return weight_rows(rows, probs.reshape(-1)).view(act.shape)
