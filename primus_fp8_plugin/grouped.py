"""Public grouped (mixture-of-experts) FP8 operations: quantization and the three GEMMs of ``E`` experts at once.

Tokens arrive permuted (expert 0's rows first, then expert 1's, ...) as ``x [T, K]`` with per-expert counts
(``group_layout``; layouts in ``grouped_tensor.py``). Every result equals, bit for bit, a loop of the dense
operations (``quantize_activation``, ``quantize_weight``, ``gemm_fwd``, ``gemm_dgrad``, ``gemm_wgrad``) over
the experts on the same backend's kernels; the reference backend computes it exactly so.

==========================  =============================================  ============================
operation                   computes (expert ``e``, tokens ``X_e``)        operands (copies)
==========================  =============================================  ============================
``gemm_fwd_grouped``        ``Y_e = X_e W_e^T (+ bias[e])``                X rowwise, W rowwise
``gemm_dgrad_grouped``      ``dX_e = dY_e W_e``                            dY rowwise, W columnwise
``gemm_wgrad_grouped``      ``dW_e = dY_e^T X_e`` (or ``main_grad_e +=``)  dY, X columnwise (padded)
==========================  =============================================  ============================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import get_backend
from .grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight, GroupLayout, group_layout
from .quantize import check_quantize_input
from .recipe import QuantParams
from .tensor import HIGH_PRECISION_DTYPES

__all__ = [
    "GroupLayout",
    "GroupedFp8Tensor",
    "GroupedFp8Weight",
    "gemm_dgrad_grouped",
    "gemm_fwd_grouped",
    "gemm_wgrad_grouped",
    "group_layout",
    "quantize_activation_grouped",
    "quantize_weight_grouped",
]


def _as_layout(counts, x: torch.Tensor) -> GroupLayout:
    if isinstance(counts, GroupLayout):
        if counts.num_tokens != x.shape[0] or counts.device != x.device:
            raise ValueError(f"layout is for {counts.num_tokens} tokens on {counts.device}, x is {tuple(x.shape)} on {x.device}")
        return counts
    return group_layout(counts, x.shape[0], x.device)


def quantize_activation_grouped(
    x: torch.Tensor,
    counts: GroupLayout | torch.Tensor | Sequence[int],
    params: QuantParams,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    backend: str = "auto",
) -> GroupedFp8Tensor:
    """1x128 quantization of the permuted tokens ``x [T, K]`` of ``E`` experts in one pass.

    Args:
        x: ``[T, K]`` bfloat16/float16/float32, expert 0's tokens first.
        counts: a ``GroupLayout``, an integer tensor ``[E]`` (checked without a host synchronisation on a GPU:
            ``grouped_tensor.group_layout``) or a list of ints (checked).
        params: 1D ``QuantParams`` (``TensorRole.INPUT`` or ``GRAD_OUTPUT``).
        rowwise: the rowwise copy ``[T, K]`` (fprop, dgrad). columnwise: the padded columnwise copy (wgrad).
    """
    check_quantize_input(x, "x", False)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, K] (permuted tokens), got shape {tuple(x.shape)}")
    if params.block_dim != 1:
        raise ValueError("quantize_activation_grouped needs 1D (1x128) QuantParams")
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise=True or columnwise=True")
    layout = _as_layout(counts, x)
    impl = get_backend(backend, x.device)
    return impl.quantize_act_grouped(x.contiguous(), layout, params, rowwise=rowwise, columnwise=columnwise)


def quantize_weight_grouped(
    weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams, *, backend: str = "auto"
) -> GroupedFp8Weight:
    """128x128 quantization of ``E`` expert weights (each ``[N, K]``, or one ``[E, N, K]`` tensor) into W and
    W^T, stacked, in one pass."""
    ws = list(weights.unbind(0)) if isinstance(weights, torch.Tensor) and weights.dim() == 3 else list(weights)
    if not ws:
        raise ValueError("quantize_weight_grouped needs at least one weight")
    for i, w in enumerate(ws):
        check_quantize_input(w, f"weights[{i}]", False)
        if w.dim() != 2 or w.shape != ws[0].shape or w.dtype != ws[0].dtype or w.device != ws[0].device or w.shape[0] == 0:
            raise ValueError(
                f"weights must be non-empty [N, K] tensors of one shape, dtype and device; weights[{i}] "
                f"is {w.dtype} {tuple(w.shape)} on {w.device}, weights[0] {ws[0].dtype} {tuple(ws[0].shape)}"
            )
    if params.block_dim != 2:
        raise ValueError("quantize_weight_grouped needs 2D (128x128) QuantParams")
    stacked = isinstance(weights, torch.Tensor) and weights.dim() == 3 and weights.is_contiguous()
    arg = weights if stacked else [w.contiguous() for w in ws]
    return get_backend(backend, ws[0].device).quantize_weight_grouped(arg, params)


def _need(t, name: str, copy: str) -> None:
    if not isinstance(t, GroupedFp8Tensor):
        raise TypeError(f"{name} must be a GroupedFp8Tensor, got {type(t).__name__}")
    if not (t.has_rowwise if copy == "rowwise" else t.has_columnwise):
        raise ValueError(f"{name} has no {copy} copy; quantize it with {copy}=True")


def _check_weight(x: GroupedFp8Tensor, w, out_dtype) -> None:
    if not isinstance(w, GroupedFp8Weight):
        raise TypeError(f"w must be a GroupedFp8Weight, got {type(w).__name__}")
    if w.num_groups != x.num_groups or w.device != x.device:
        raise ValueError(f"w holds {w.num_groups} experts on {w.device}, the tokens {x.num_groups} on {x.device}")
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def gemm_fwd_grouped(
    x: GroupedFp8Tensor,
    w: GroupedFp8Weight,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """``Y [T, N]``, expert ``e``'s rows ``X_e W_e^T (+ bias[e])``; ``bias``: ``[E, N]`` (contiguous) or None."""
    _need(x, "x", "rowwise")
    _check_weight(x, w, out_dtype)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"inner dims differ: x is {x.shape}, each expert's w is {w.shape}")
    if bias is not None and (tuple(bias.shape) != (w.num_groups, w.shape[0]) or bias.device != x.device
                             or bias.dtype not in HIGH_PRECISION_DTYPES or not bias.is_contiguous()):  # fmt: skip
        raise ValueError(f"bias must be a contiguous [{w.num_groups}, {w.shape[0]}] bf16/fp16/fp32 tensor on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")  # fmt: skip
    return get_backend(backend, x.device).gemm_fwd_grouped(x, w, bias, out_dtype)


def gemm_dgrad_grouped(
    dy: GroupedFp8Tensor, w: GroupedFp8Weight, *, out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"
) -> torch.Tensor:
    """``dX [T, K]``, expert ``e``'s rows ``dY_e W_e``."""
    _need(dy, "dy", "rowwise")
    _check_weight(dy, w, out_dtype)
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"dy is {dy.shape} but each expert's w is {w.shape}: dy must be [T, N] for w [N, K]")
    return get_backend(backend, dy.device).gemm_dgrad_grouped(dy, w, out_dtype)


def gemm_wgrad_grouped(
    dy: GroupedFp8Tensor,
    x: GroupedFp8Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    accumulate_into: Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
) -> list[torch.Tensor]:
    """``dW_e [N, K] = dY_e^T X_e`` for each expert from the columnwise copies of ``dy [T, N]`` and ``x [T, K]``
    (quantized for the same routing). Returns ``E`` tensors; with ``accumulate_into`` (``E`` contiguous fp32
    ``[N, K]`` tensors, which need not be adjacent in memory) the results are added into them in place."""
    _need(dy, "dy", "columnwise")
    _need(x, "x", "columnwise")
    lay_a, lay_b = dy.layout, x.layout
    if (lay_a.num_groups, lay_a.num_tokens, lay_a.capacity) != (lay_b.num_groups, lay_b.num_tokens, lay_b.capacity):
        raise ValueError("dy and x were quantized for different routings (expert count, tokens or capacity differ)")
    if dy.device != x.device:
        raise ValueError(f"operands are on different devices: {dy.device} and {x.device}")
    n, k = dy.shape[1], x.shape[1]
    if accumulate_into is not None:
        accumulate_into = list(accumulate_into)
        if len(accumulate_into) != x.num_groups:
            raise ValueError(f"accumulate_into holds {len(accumulate_into)} tensors for {x.num_groups} experts")
        for i, acc in enumerate(accumulate_into):
            if acc.dtype != torch.float32 or tuple(acc.shape) != (n, k) or acc.device != x.device or not acc.is_contiguous():
                raise ValueError(f"accumulate_into[{i}] must be a contiguous float32 [{n}, {k}] tensor on {x.device}, got "
                                 f"{acc.dtype} {tuple(acc.shape)} on {acc.device}")  # fmt: skip
    elif out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return get_backend(backend, x.device).gemm_wgrad_grouped(dy, x, out_dtype, accumulate_into)
