"""Column-parallel FP8 linears under sequence parallelism: quantize the local shard, all-gather in FP8.

Under Megatron's sequence parallelism each tensor-parallel rank holds ``s/tp`` of the sequence; a
column-parallel layer needs the whole sequence. The plain way (``gather``, then ``fp8_blockwise_linear``)
all-gathers the bf16 input, quantizes the gathered sequence and saves its columnwise FP8 copy, which
is ``tp`` times the local shard. Here, as Transformer Engine does:

Forward:  X_local [m, K] --quantize (rowwise 1x128 along K; columnwise 128x1 along the tokens)-->
          all-gather the rowwise FP8 data and its scales -> rowwise copy of X [tp*m, K] -> Y = X W^T (+ b)
Saved:    the local shard's columnwise FP8 copy and scales (``m*K*(1 + 1/32)`` bytes), never X.
Backward: dY [tp*m, N] quantized as ``linear.py`` does; the saved columnwise copies all-gathered again
          (FP8) for wgrad while dgrad runs; dX [tp*m, K] reduce-scattered to X_local's gradient
          (``reduce_scatter_tensor``, as Megatron's ``gather_from_sequence_parallel_region`` does) while
          wgrad runs.

Bit for bit the plain way (output, input, weight and bias gradients): a rowwise tile lies in one row,
and a columnwise 128x1 tile lies in one rank's shard when ``m % 128 == 0``, so quantizing the shards
gives the bits of quantizing the gathered sequence, and the GEMMs read the same bits. Where
``m % 128 != 0`` and wgrad is needed, the columnwise tiles would straddle ranks: these functions then
take the plain way (bf16 all-gather, as TE does). ``x``'s rows are its flattened leading dims, so the
sequence must be the outermost dim (Megatron's ``[s, b, h]``).

Layouts (``tensor.py``): the gathered rowwise copy is the ranks' data stacked along rows, its scales
``[ceil(K/128), pad4(tp*m)]`` re-packed from the ranks' ``[ceil(K/128), pad4(m)]``; the gathered
columnwise copy is ``[K, tp*m]`` (the ranks' ``[K, m]`` side by side, one copy) with scales
``[tp*m/128, pad4(K)]`` (the ranks' scales stacked: no copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backends import Backend, get_backend
from .fused_norm_linear import quantized_weight
from .linear import _check_inputs, _keeps_graph, fp8_blockwise_linear, keep_weight, weight_gradient
from .normalization import check_norm_inputs, norm, norm_gamma
from .recipe import BLOCK, BlockwiseRecipe, TensorRole
from .tensor import BlockwiseFp8Tensor, pad4
from .weight_cache import WeightCache

# ---- collectives along the rows (dim 0), FP8 moved as bytes (gloo has no FP8 types) -------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _all_gather_rows(t: torch.Tensor, group, world: int, async_op: bool = False):
    """``[world * rows, ...]``: every rank's contiguous ``t`` stacked in rank order (and the work handle when
    ``async_op``)."""
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    work = dist.all_gather_into_tensor(_bytes(out), _bytes(t.contiguous()), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _reduce_scatter_rows(t: torch.Tensor, group, world: int, async_op: bool = False):
    """This rank's ``[rows / world, ...]`` block of the sum over ranks of ``t`` (and the work handle)."""
    out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    work = dist.reduce_scatter_tensor(out, t.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


class _GatherRows(torch.autograd.Function):
    """bf16 all-gather along dim 0 whose backward reduce-scatters (the plain way's gather)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _all_gather_rows(x, group, world)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_rows(dy, ctx.group, ctx.world), None, None


def gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather ``x [s_local, ...]`` along dim 0 over ``group`` -> ``[world * s_local, ...]``; the gradient is
    reduce-scattered back (each rank's gradient of the gathered tensor is a partial sum)."""
    world = dist.get_world_size(group)
    return x if world == 1 else _GatherRows.apply(x, group, world)


# ---- gathered quantized copies ---------------------------------------------------------------------------


def _gather_rowwise(xq: BlockwiseFp8Tensor, group, world: int) -> BlockwiseFp8Tensor:
    """The rowwise copy of the gathered rows from every rank's rowwise copy of its shard."""
    m, k = xq.shape
    data, w1 = _all_gather_rows(xq.rowwise_data, group, world, async_op=True)
    scales, w2 = _all_gather_rows(xq.rowwise_scale_inv.unsqueeze(0), group, world, async_op=True)  # [world, K/128, pad4(m)]
    w1.wait()
    w2.wait()
    kb = scales.shape[1]
    scale_inv = torch.ones((kb, pad4(world * m)), dtype=torch.float32, device=data.device)
    scale_inv[:, : world * m].view(kb, world, m).copy_(scales[:, :, :m].permute(1, 0, 2))
    return BlockwiseFp8Tensor((world * m, k), 1, xq.fp8_dtype, xq.orig_dtype, rowwise_data=data, rowwise_scale_inv=scale_inv)


def _start_gather_columnwise(col: torch.Tensor, col_scale: torch.Tensor, group, world: int) -> tuple:
    """Start the all-gather of a shard's columnwise copy (``[K, m]`` data, ``[m/128, pad4(K)]`` scales)."""
    data, w1 = _all_gather_rows(col.unsqueeze(0), group, world, async_op=True)  # [world, K, m]
    scales, w2 = _all_gather_rows(col_scale, group, world, async_op=True)  # [world*m/128, pad4(K)]: final
    return data, scales, (w1, w2)


def _finish_gather_columnwise(started: tuple, shape: tuple[int, int], fp8, orig_dtype) -> BlockwiseFp8Tensor:
    data, scales, works = started
    for w in works:
        w.wait()
    world, k, m = data.shape
    col = data.permute(1, 0, 2).reshape(k, world * m)  # the ranks' [K, m] side by side
    return BlockwiseFp8Tensor(shape, 1, fp8, orig_dtype, columnwise_data=col, columnwise_scale_inv=scales)


def fp8_gather_possible(local_rows: int, need_wgrad: bool) -> bool:
    """Whether a shard of ``local_rows`` rows can be quantized before the all-gather with the same bits as the
    gathered sequence: always for the rowwise copy alone; with wgrad's columnwise copy (128x1 tiles along the
    rows) when ``local_rows % 128 == 0``."""
    return local_rows > 0 and (not need_wgrad or local_rows % BLOCK == 0)


# ---- the shared linear part of both ops ----------------------------------------------------------------


def _forward_linear(ctx, xq, weight, bias, recipe, backend, cache, refresh, group, world, out_dtype):
    """Gather ``xq``'s rowwise copy, run fprop, keep what ``_backward_linear`` reads; returns ``Y [tp*m, N]``."""
    wq = quantized_weight(weight, recipe, backend, cache, refresh)
    y = backend.gemm_fwd(_gather_rowwise(xq, group, world), wq, bias, out_dtype)
    ctx.wq, ctx.recipe, ctx.backend, ctx.group, ctx.world = wq, recipe, backend, group, world
    ctx.x_meta = ((world * xq.shape[0], xq.shape[1]), xq.fp8_dtype, out_dtype)
    ctx.has_bias = bias is not None
    keep_weight(ctx, weight)
    return y


def _backward_linear(ctx, dy, x_col, x_col_scale, need_dinput: bool, need_dw: bool, need_db: bool):
    """``(d_input_local [m, K] or None, dW, db)``: dgrad of the gathered rows reduce-scattered to this rank's
    shard, overlapped with wgrad, which reads the re-gathered columnwise copies."""
    backend: Backend = ctx.backend
    (m_all, k), fp8, x_dtype = ctx.x_meta
    weight = ctx.weight
    dy2d = dy.reshape(-1, weight.shape[0])
    if not dy2d.is_contiguous():
        dy2d = dy2d.contiguous()
    dyq = None
    if need_dinput or need_dw:
        dyq = backend.quantize_act(dy2d, ctx.recipe.params(TensorRole.GRAD_OUTPUT), rowwise=need_dinput, columnwise=need_dw)
    started = _start_gather_columnwise(x_col, x_col_scale, ctx.group, ctx.world) if need_dw else None
    d_input, rs_work = None, None
    if need_dinput:
        d_input, rs_work = _reduce_scatter_rows(backend.gemm_dgrad(dyq, ctx.wq, x_dtype), ctx.group, ctx.world, async_op=True)
    dw = None
    if need_dw:
        dw = weight_gradient(backend, dyq, _finish_gather_columnwise(started, (m_all, k), fp8, x_dtype), weight)
    db = dy2d.sum(0) if (ctx.has_bias and need_db) else None
    if rs_work is not None:
        rs_work.wait()
    if not _keeps_graph():
        ctx.wq = None
    return d_input, dw, db


def _columnwise(xq: BlockwiseFp8Tensor, need_wgrad: bool) -> tuple:
    return (xq.columnwise_data, xq.columnwise_scale_inv) if need_wgrad else (None, None)


class _Fp8SpColumnLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, backend, cache, refresh, group, world, need_wgrad):
        k = weight.shape[1]
        x2d = x.reshape(-1, k)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        xq = backend.quantize_act(x2d, recipe.params(TensorRole.INPUT), rowwise=True, columnwise=need_wgrad)
        y = _forward_linear(ctx, xq, weight, bias, recipe, backend, cache, refresh, group, world, x.dtype)
        ctx.save_for_backward(*_columnwise(xq, need_wgrad))
        ctx.x_shape = x.shape
        return y.view(world * x.shape[0], *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x_col, x_col_scale = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = _backward_linear(ctx, dy, x_col, x_col_scale, need_dx, need_dw, need_db)
        return (None if dx is None else dx.view(ctx.x_shape)), dw, db, None, None, None, None, None, None, None


class _Fp8SpNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, weight, bias, normalization, eps, recipe, backend, cache, refresh, group, world,
                need_wgrad):  # fmt: skip
        h = x.shape[-1]
        x2d = x.reshape(-1, h)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        xq, mean, rstd = backend.quantize_norm_act(x2d, gamma, beta, eps, normalization, recipe.params(TensorRole.INPUT),
                                                   rowwise=True, columnwise=need_wgrad)  # fmt: skip
        y = _forward_linear(ctx, xq, weight, bias, recipe, backend, cache, refresh, group, world, x.dtype)
        ctx.save_for_backward(x2d, gamma, mean, rstd, *_columnwise(xq, need_wgrad))
        ctx.x_shape = x.shape
        return y.view(world * x.shape[0], *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, gamma, mean, rstd, x_col, x_col_scale = ctx.saved_tensors
        need_dx, need_dgamma, need_dbeta, need_dw, need_db = ctx.needs_input_grad[:5]
        need_dnormed = need_dx or need_dgamma or need_dbeta
        dnormed, dw, db = _backward_linear(ctx, dy, x_col, x_col_scale, need_dnormed, need_dw, need_db)
        dx = dgamma = dbeta = None
        if need_dnormed:
            dx, dgamma, dbeta = ctx.backend.norm_bwd(dnormed, x2d, gamma, mean, rstd, need_dgamma=need_dgamma,
                                                     need_dbeta=need_dbeta)  # fmt: skip
            dx = dx.view(ctx.x_shape) if need_dx else None
        return dx, dgamma, dbeta, dw, db, None, None, None, None, None, None, None, None, None


# ---- public functions ------------------------------------------------------------------------------------


def _world(group, x: torch.Tensor) -> int:
    if not dist.is_initialized():
        raise RuntimeError("sequence-parallel FP8 linears need torch.distributed initialised (the tensor-parallel group)")
    if x.dim() < 2:
        raise ValueError(f"x must be [s_local, ..., K] (the sequence outermost), got shape {tuple(x.shape)}")
    return dist.get_world_size(group)


def _need_wgrad(weight: torch.Tensor) -> bool:
    return weight.requires_grad and torch.is_grad_enabled()


def _fp8_path(x: torch.Tensor, weight: torch.Tensor, world: int) -> bool:
    if world == 1 or weight.shape[0] == 0 or weight.shape[1] == 0 or weight.is_inference():
        return False
    return fp8_gather_possible(x.numel() // x.shape[-1], _need_wgrad(weight))


def fp8_sequence_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: WeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``gather(x) W^T + b`` for a column-parallel layer under sequence parallelism, all-gathering in FP8.

    Args:
        x: this rank's sequence shard ``[s_local, ..., in_features]`` (bf16/fp16/fp32), the sequence outermost;
            its rows (``s_local * prod(middle dims)``) are one rank's block of the gathered rows.
        weight: this rank's ``[out_features / tp, in_features]`` shard; ``main_grad`` as for
            ``fp8_blockwise_linear``. bias: ``[out_features / tp]`` or None.
        group: the tensor-parallel process group (None: the default group).
        recipe, backend, weight_cache, refresh_weight_cache: as for ``fp8_blockwise_linear``.

    Returns:
        ``[tp * s_local, ..., out_features / tp]`` in x's dtype; the same bits, and the same gradients (the
        input's reduce-scattered), as ``fp8_blockwise_linear(gather_rows(x, group), weight, bias)``, which it
        runs where the FP8 gather cannot give them (rows not a multiple of 128 with wgrad needed, a single
        rank, an empty weight, an inference-tensor weight).
    """
    _check_inputs(x, weight, bias)
    world = _world(group, x)
    fp8 = dict(recipe=recipe, backend=backend, weight_cache=weight_cache, refresh_weight_cache=refresh_weight_cache)
    if not _fp8_path(x, weight, world):
        return fp8_blockwise_linear(gather_rows(x, group), weight, bias, **fp8)
    args = (x, weight, bias)
    run = _eager if torch.compiler.is_compiling() else _apply
    return run(_Fp8SpColumnLinearFn, args, weight, recipe, backend, weight_cache, refresh_weight_cache, group, world)


def fp8_sequence_parallel_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    normalization: str = "LayerNorm",
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    group=None,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: WeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``gather(norm(x)) W^T + b`` under sequence parallelism: the norm of this rank's shard fused with its
    quantization (``fused_norm_linear``), then the FP8 all-gather of ``fp8_sequence_parallel_linear``.

    Args: as ``fp8_norm_linear`` and ``fp8_sequence_parallel_linear`` (``x`` is the local shard). The gradients
    of ``norm_weight``/``norm_bias`` are this rank's tokens' part (Megatron all-reduces sequence-parallel
    parameters' gradients).

    Returns:
        ``[tp * s_local, ..., out_features / tp]``: the same bits and gradients as
        ``fp8_blockwise_linear(gather_rows(norm(x, ...), group), weight, bias)``, which it runs where the FP8
        gather cannot give them (see ``fp8_sequence_parallel_linear``).
    """
    _check_inputs(x, weight, bias)
    check_norm_inputs(x, normalization, norm_weight, norm_bias)
    world = _world(group, x)
    fp8 = dict(recipe=recipe, backend=backend, weight_cache=weight_cache, refresh_weight_cache=refresh_weight_cache)
    if not _fp8_path(x, weight, world):
        normed = norm(x, normalization, norm_weight, norm_bias, eps, zero_centered_gamma, backend=backend)
        return fp8_blockwise_linear(gather_rows(normed, group), weight, bias, **fp8)
    gamma = norm_gamma(norm_weight, zero_centered_gamma)
    args = (x, gamma, norm_bias, weight, bias, normalization, float(eps))
    run = _eager if torch.compiler.is_compiling() else _apply
    return run(_Fp8SpNormLinearFn, args, weight, recipe, backend, weight_cache, refresh_weight_cache, group, world)


def _apply(fn, args: tuple, weight, recipe, backend, cache, refresh, group, world):
    impl = backend if isinstance(backend, Backend) else get_backend(backend, weight.device)
    return fn.apply(*args, recipe or BlockwiseRecipe(), impl, cache, refresh, group, world, _need_wgrad(weight))


@torch.compiler.disable
def _eager(fn, *args):
    """Inside ``torch.compile``: run eagerly between compiled graphs (as ``linear.py`` does)."""
    return _apply(fn, *args)
