"""Public blockwise FP8 GEMMs of a linear layer: fprop, dgrad and wgrad.

================  ==========================  ==============================  ===========
GEMM              computes                    operands (copies)               scaling
================  ==========================  ==============================  ===========
``gemm_fwd``      Y [M, N] = X W^T (+ bias)   X rowwise, W rowwise            1D x 2D
``gemm_dgrad``    dX [M, K] = dY W            dY rowwise, W columnwise (W^T)  1D x 2D
``gemm_wgrad``    dW [N, K] = dY^T X          dY columnwise, X columnwise     1D x 1D
================  ==========================  ==============================  ===========
"""

from __future__ import annotations

import torch

from .backends import get_backend
from .tensor import HIGH_PRECISION_DTYPES, BlockwiseFp8Tensor


def _need(t: BlockwiseFp8Tensor, name: str, block_dim: int, copy: str) -> None:
    if not isinstance(t, BlockwiseFp8Tensor):
        raise TypeError(f"{name} must be a BlockwiseFp8Tensor, got {type(t).__name__}")
    if t.block_dim != block_dim:
        tiles = "1x128" if block_dim == 1 else "128x128"
        raise ValueError(f"{name} must be quantized with {tiles} tiles (block_dim={block_dim}), got {t.block_dim}")
    has = t.has_rowwise if copy == "rowwise" else t.has_columnwise
    if not has:
        raise ValueError(f"{name} has no {copy} copy; quantize it with {copy}=True")


def _check_common(a: BlockwiseFp8Tensor, b: BlockwiseFp8Tensor, out_dtype: torch.dtype) -> None:
    if a.device != b.device:
        raise ValueError(f"operands are on different devices: {a.device} and {b.device}")
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def gemm_fwd(
    x: BlockwiseFp8Tensor,
    w: BlockwiseFp8Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Forward ``Y [M, N] = X W^T (+ bias)``; ``x`` (M, K) 1x128 rowwise, ``w`` (N, K) 128x128."""
    _need(x, "x", 1, "rowwise")
    _need(w, "w", 2, "rowwise")
    _check_common(x, w, out_dtype)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"inner dims differ: x is {x.shape}, w is {w.shape} (both must be [*, K])")
    if bias is not None:
        if bias.shape != (w.shape[0],) or bias.device != x.device or bias.dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(
                f"bias must be a [{w.shape[0]}] bf16/fp16/fp32 tensor on {x.device}, "
                f"got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
            )
    return get_backend(backend, x.device).gemm_fwd(x, w, bias, out_dtype)


def gemm_dgrad(
    dy: BlockwiseFp8Tensor,
    w: BlockwiseFp8Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Data gradient ``dX [M, K] = dY W``; ``dy`` (M, N) 1x128 rowwise, ``w`` (N, K) with its W^T copy."""
    _need(dy, "dy", 1, "rowwise")
    _need(w, "w", 2, "columnwise")
    _check_common(dy, w, out_dtype)
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"dy is {dy.shape} but w is {w.shape}: dy must be [M, N] for w [N, K]")
    return get_backend(backend, dy.device).gemm_dgrad(dy, w, out_dtype)


def gemm_wgrad(
    dy: BlockwiseFp8Tensor,
    x: BlockwiseFp8Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    accumulate_into: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Weight gradient ``dW [N, K] = dY^T X`` from the columnwise copies of ``dy`` (M, N) and ``x`` (M, K).

    With ``accumulate_into`` (a contiguous fp32 [N, K] tensor, e.g. Megatron's ``main_grad``) the
    result is added into it in place and it is returned; ``out_dtype`` is then ignored.
    """
    _need(dy, "dy", 1, "columnwise")
    _need(x, "x", 1, "columnwise")
    _check_common(dy, x, out_dtype)
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy is {dy.shape} and x is {x.shape}: both must have the same M (rows)")
    n, k = dy.shape[1], x.shape[1]
    if accumulate_into is not None:
        if (
            accumulate_into.dtype != torch.float32
            or tuple(accumulate_into.shape) != (n, k)
            or accumulate_into.device != x.device
            or not accumulate_into.is_contiguous()
        ):
            raise ValueError(
                f"accumulate_into must be a contiguous float32 [{n}, {k}] tensor on {x.device}, got "
                f"{accumulate_into.dtype} {tuple(accumulate_into.shape)} on {accumulate_into.device}"
            )
    return get_backend(backend, x.device).gemm_wgrad(dy, x, out_dtype, accumulate_into)
