"""What every backend implements: five operations on :class:`BlockwiseFp8Tensor`.

Arguments reach a backend already checked by the public functions in
``primus_fp8_plugin.quantize`` and ``primus_fp8_plugin.gemm`` (dtypes, shapes, devices, which
copies exist); a backend asserts only what is specific to its kernels.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from ..recipe import QuantParams
from ..tensor import BlockwiseFp8Tensor


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a device, and if not, why (a sentence a user can act on).

    ``auto=False`` marks a backend that works but that ``"auto"`` should not pick (e.g. Triton's
    CPU interpreter, which exists for tests).
    """

    available: bool
    reason: str = ""
    auto: bool = True

    def __bool__(self) -> bool:
        return self.available


class Backend(abc.ABC):
    """A set of kernels for FP8 blockwise training. One instance per backend name."""

    name: str = ""

    @abc.abstractmethod
    def availability(self, device: torch.device) -> Availability:
        """Whether this backend can run on ``device`` in this process."""

    @abc.abstractmethod
    def quantize_act(self, x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool) -> BlockwiseFp8Tensor:
        """1x128 quantization of an activation or gradient ``x [M, K]`` (contiguous).

        ``rowwise``: data [M, K] with 1x128 tiles; ``columnwise``: data [K, M] = x^T with tiles
        of 128 along M, quantized from ``x`` itself. Either may be skipped.
        """

    @abc.abstractmethod
    def quantize_weight(self, w: torch.Tensor, params: QuantParams) -> BlockwiseFp8Tensor:
        """128x128 quantization of ``w [N, K]`` (contiguous) into both copies (W and W^T)."""

    @abc.abstractmethod
    def gemm_fwd(
        self, x: BlockwiseFp8Tensor, w: BlockwiseFp8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """``Y [M, N] = X W^T (+ bias)`` from X's rowwise copy (1x128) and W's rowwise copy (128x128)."""

    @abc.abstractmethod
    def gemm_dgrad(self, dy: BlockwiseFp8Tensor, w: BlockwiseFp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``dX [M, K] = dY W`` from dY's rowwise copy (1x128) and W's columnwise copy (W^T, 128x128)."""

    @abc.abstractmethod
    def gemm_wgrad(
        self,
        dy: BlockwiseFp8Tensor,
        x: BlockwiseFp8Tensor,
        out_dtype: torch.dtype,
        accumulate_into: torch.Tensor | None,
    ) -> torch.Tensor:
        """``dW [N, K] = dY^T X`` from the columnwise copies of dY and X (both 128 along M).

        With ``accumulate_into`` (fp32 [N, K]) the result is added to it in place and it is returned.
        """
