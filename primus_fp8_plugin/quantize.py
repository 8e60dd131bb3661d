"""Public quantization entry points: check the input, pick the backend, quantize.

Every backend receives contiguous 2-D input of a supported dtype on a device it supports.
"""

from __future__ import annotations

import torch

from .backends import get_backend
from .recipe import QuantParams
from .tensor import HIGH_PRECISION_DTYPES, BlockwiseFp8Tensor


def check_quantize_input(x: torch.Tensor, what: str, check_finite: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what} has dtype {x.dtype}; FP8 quantization takes bfloat16, float16 or float32 (convert with .to(torch.bfloat16))"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"{what} has an empty last dimension (shape {tuple(x.shape)})")
    if check_finite:
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{what} holds {int(bad.sum())} non-finite value(s) (first at index {first}); "
                "FP8 quantization would turn their tiles into NaN"
            )


def quantize_activation(
    x: torch.Tensor,
    params: QuantParams,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    backend: str = "auto",
    check_finite: bool = False,
) -> BlockwiseFp8Tensor:
    """Quantize an activation or output gradient with 1x128 tiles.

    Args:
        x: ``[..., K]`` bfloat16, float16 or float32; leading dims are flattened to ``M``.
        params: a 1D ``QuantParams`` (``recipe.params(TensorRole.INPUT)`` or ``GRAD_OUTPUT``).
        rowwise: produce the rowwise copy ``[M, K]`` (tiles of 128 along K) for fprop / dgrad.
        columnwise: produce the columnwise copy ``[K, M]`` (tiles of 128 along M) for wgrad.
        backend: a registered backend name or ``"auto"``.
        check_finite: raise ValueError if ``x`` holds NaN or Inf (costs a device sync). Without
            it a tile holding NaN/Inf quantizes to NaN data with a NaN scale_inv.

    Returns:
        a ``BlockwiseFp8Tensor`` of logical shape ``(M, K)``, ``block_dim=1``.
    """
    check_quantize_input(x, "x", check_finite)
    if params.block_dim != 1:
        raise ValueError("quantize_activation needs 1D (1x128) QuantParams; use quantize_weight for 128x128")
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise=True or columnwise=True")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., K], got shape {tuple(x.shape)}")
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    impl = get_backend(backend, x.device)
    return impl.quantize_act(x2d, params, rowwise=rowwise, columnwise=columnwise)


def quantize_weight(
    w: torch.Tensor,
    params: QuantParams,
    *,
    backend: str = "auto",
    check_finite: bool = False,
) -> BlockwiseFp8Tensor:
    """Quantize a weight ``[N, K]`` with 128x128 blocks into both copies (W for fprop, W^T for dgrad).

    Args:
        w: ``[N, K]`` bfloat16, float16 or float32.
        params: a 2D ``QuantParams`` (``recipe.params(TensorRole.WEIGHT)``).
        backend, check_finite: as for :func:`quantize_activation`.

    Returns:
        a ``BlockwiseFp8Tensor`` of shape ``(N, K)``, ``block_dim=2``, with both copies.
    """
    check_quantize_input(w, "weight", check_finite)
    if params.block_dim != 2:
        raise ValueError("quantize_weight needs 2D (128x128) QuantParams; use quantize_activation for 1x128")
    if w.dim() != 2 or w.shape[0] == 0:
        raise ValueError(f"weight must be 2-D [N, K] with N, K >= 1, got shape {tuple(w.shape)}")
    impl = get_backend(backend, w.device)
    return impl.quantize_weight(w.contiguous(), params)
