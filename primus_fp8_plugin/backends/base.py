"""What every backend implements: five operations on :class:`BlockwiseFp8Tensor`, and optionally their
grouped (mixture-of-experts) forms on ``GroupedFp8Tensor`` / ``GroupedFp8Weight`` (``grouped_tensor.py``)
and the fused ops (norm, SwiGLU and RoPE, with or without the FP8 quantization of their output).

Arguments reach a backend already checked by the public functions in
``primus_fp8_plugin.quantize`` and ``primus_fp8_plugin.gemm`` (dtypes, shapes, devices, which
copies exist); a backend asserts only what is specific to its kernels.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight, GroupLayout
from ..recipe import QuantParams
from ..tensor import BlockwiseFp8Tensor, transpose_blocks


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

    def transpose_weight(self, w: BlockwiseFp8Tensor) -> BlockwiseFp8Tensor:
        """``w`` (a 128x128 weight, its W copy at least) with its W^T copy, made from W as the exact transpose of its
        blocks and scales: the bits ``quantize_weight`` gives (``tensor.transpose_blocks``, the torch form here;
        backends with kernels override it). dgrad's W^T on demand, for weights held as W only."""
        return w.with_columnwise(*transpose_blocks(w.rowwise_data, w.rowwise_scale_inv))

    def transpose_weight_grouped(self, w: GroupedFp8Weight) -> GroupedFp8Weight:
        """``w`` (``E`` experts' 128x128 weights) with their W^T copies, as ``transpose_weight`` for each expert."""
        return w.with_columnwise(*transpose_blocks(w.rowwise_data, w.rowwise_scale_inv))

    # ---- grouped (mixture-of-experts) operations: optional; results equal a loop of the dense ones ----
    def _no_grouped(self, op: str) -> NotImplementedError:
        return NotImplementedError(
            f"backend {self.name!r} has no grouped (mixture-of-experts) kernels ({op}): use backend='triton' or "
            "'reference' for grouped experts, or Megatron's SequentialMLP experts (moe_grouped_gemm=False)"
        )

    def quantize_act_grouped(
        self, x: torch.Tensor, layout: GroupLayout, params: QuantParams, *, rowwise: bool, columnwise: bool,
        rows: torch.Tensor | None = None,
    ) -> GroupedFp8Tensor:  # fmt: skip
        """1x128 quantization of permuted tokens ``x [T, K]`` (contiguous): rowwise unpadded, columnwise with
        each expert's tokens zero-padded to a multiple of 128 (``grouped_tensor.py``). ``rows`` (int ``[T']``):
        the permuted tokens are ``x[rows]`` (an MoE layer's token permutation), which is not written."""
        raise self._no_grouped("quantize_act_grouped")

    def quantize_swiglu_act_grouped(
        self, h: torch.Tensor, layout: GroupLayout, params: QuantParams, *, rowwise: bool, columnwise: bool,
        probs: torch.Tensor | None = None,
    ) -> GroupedFp8Tensor:  # fmt: skip
        """``quantize_act_grouped`` of ``swiglu_fwd(h)`` (fc1's output ``h [T, 2K]``, contiguous), each row times
        ``probs [T]`` (``reference_fused.weight_rows``) where given, without writing the activation (same bits)."""
        raise self._no_grouped("quantize_swiglu_act_grouped")

    def quantize_weight_grouped(
        self, weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams, out: GroupedFp8Weight | None = None
    ) -> GroupedFp8Weight:
        """128x128 quantization of ``E`` weights (contiguous ``[N, K]`` each, or one ``[E, N, K]``) into W and W^T,
        written into ``out`` when given (its buffers of the right shapes)."""
        raise self._no_grouped("quantize_weight_grouped")

    def gemm_fwd_grouped(
        self, x: GroupedFp8Tensor, w: GroupedFp8Weight, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """``Y [T, N]``: expert ``e``'s rows ``= X_e W_e^T (+ bias[e])``; ``bias`` is ``[E, N]`` or None."""
        raise self._no_grouped("gemm_fwd_grouped")

    def gemm_dgrad_grouped(self, dy: GroupedFp8Tensor, w: GroupedFp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
        """``dX [T, K]``: expert ``e``'s rows ``= dY_e W_e`` (W^T copies)."""
        raise self._no_grouped("gemm_dgrad_grouped")

    def gemm_wgrad_grouped(
        self,
        dy: GroupedFp8Tensor,
        x: GroupedFp8Tensor,
        out_dtype: torch.dtype,
        accumulate_into: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        """``dW_e [N, K] = dY_e^T X_e`` for every expert, from the columnwise copies. Returns ``E`` tensors (views
        of one ``[E, N, K]`` buffer), or, with ``accumulate_into`` (``E`` contiguous fp32 ``[N, K]`` tensors
        anywhere in memory, e.g. Megatron's ``main_grad``), adds into them in place and returns them."""
        raise self._no_grouped("gemm_wgrad_grouped")

    # ---- fused ops (optional): the spec is backends/reference_fused.py, docs/NUMERICS.md "Fused ops" ----

    def _no_fused(self, op: str):
        return NotImplementedError(f"backend {self.name!r} has no {op}: use backend='triton' (GPU) or 'reference' (any device)")

    def norm_fwd(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, eps: float, normalization: str):
        """LayerNorm / RMSNorm of ``x [M, H]`` (contiguous) over H -> ``(y [M, H] in x's dtype, mean, rstd)``;
        mean and rstd fp32 ``[M]`` (mean None for RMSNorm). ``gamma``/``beta``: ``[H]``, beta None for RMSNorm."""
        raise self._no_fused("norm_fwd")

    def quantize_norm_act(self, x, gamma, beta, eps, normalization, params: QuantParams, *, rowwise: bool, columnwise: bool):
        """``norm_fwd`` followed by ``quantize_act`` of its output, without writing the output:
        ``(BlockwiseFp8Tensor of shape (M, H), mean, rstd)``, the same bits as the two steps."""
        raise self._no_fused("quantize_norm_act")

    def norm_bwd(self, dy, x, gamma, mean, rstd, *, need_dgamma: bool, need_dbeta: bool):
        """Gradients of ``norm_fwd`` for ``dy [M, H]`` (x's dtype): ``(dx, dgamma, dbeta)``, dgamma and
        dbeta in gamma's dtype or None where not asked. ``mean`` is None for RMSNorm."""
        raise self._no_fused("norm_bwd")

    def swiglu_fwd(self, h: torch.Tensor) -> torch.Tensor:
        """``silu(a) * b`` of ``h [M, 2F] = [a | b]`` (contiguous) -> ``[M, F]`` in h's dtype."""
        raise self._no_fused("swiglu_fwd")

    def quantize_swiglu_act(self, h, params: QuantParams, *, rowwise: bool, columnwise: bool) -> BlockwiseFp8Tensor:
        """``swiglu_fwd`` followed by ``quantize_act``, without writing the activation (same bits)."""
        raise self._no_fused("quantize_swiglu_act")

    def swiglu_bwd(self, dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``dh [M, 2F]`` of ``swiglu_fwd`` for ``dy [M, F]``, recomputed from ``h``."""
        raise self._no_fused("swiglu_bwd")

    def unpermute(self, y: torch.Tensor, sorted_indices: torch.Tensor, token_rows: torch.Tensor,
                  token_offsets: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """An MoE layer's combine: ``out [T, H]`` in y's dtype, token ``t`` the sum of its permuted rows of ``y [N, H]``
        (``sorted_indices [N]``: each row's token; the same as ``token_rows [N]`` int32, the rows grouped by token in
        increasing order, token ``t``'s from ``token_offsets[t]`` to ``token_offsets[t + 1]``, ``[T + 1]`` int32),
        each times ``probs [N]`` where given, summed in fp32 in the rows' order and rounded once to the product's
        dtype (``reference_fused.unpermute``)."""
        raise self._no_fused("unpermute")

    def rope(self, t, cos, sin, *, interleaved: bool, backward: bool) -> torch.Tensor:
        """Rotary embedding of ``t [s, b, h, d]`` (last dim contiguous) with ``cos``/``sin``
        ``[s, 1 or b, 1, rot]`` in t's dtype -> a new contiguous ``[s, b, h, d]``; ``backward``: its
        gradient for an output gradient ``t``."""
        raise self._no_fused("rope")


FUSED_OPS = ("norm_fwd", "quantize_norm_act", "norm_bwd", "swiglu_fwd", "quantize_swiglu_act", "swiglu_bwd", "rope",
             "unpermute")  # fmt: skip
GROUPED_OPS = (
    "quantize_act_grouped",
    "quantize_swiglu_act_grouped",
    "quantize_weight_grouped",
    "gemm_fwd_grouped",
    "gemm_dgrad_grouped",
    "gemm_wgrad_grouped",
)
WEIGHT_OPS = ("transpose_weight", "transpose_weight_grouped")


def fused_ops_from_triton(cls: type) -> type:
    """Class decorator: a backend that holds a ``TritonBackend`` as ``self.triton`` runs the fused
    ops (norm, SwiGLU, RoPE), the grouped (mixture-of-experts) ops and the W^T transposes through it, but those
    its class body defines itself."""

    def delegate(name):
        def method(self, *args, **kwargs):
            return getattr(self.triton, name)(*args, **kwargs)

        method.__name__ = name
        method.__doc__ = f"``{name}`` of the triton backend this backend holds."
        return method

    for name in FUSED_OPS + GROUPED_OPS + WEIGHT_OPS:
        if name not in vars(cls):
            setattr(cls, name, delegate(name))
    return cls
