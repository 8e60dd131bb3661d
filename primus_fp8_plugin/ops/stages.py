"""Input stages of the FP8 linear core: what turns the op's inputs into the quantized X the GEMMs read, and the
backward of that step. A stage hands the core X's rowwise copy (for fprop) and, when wgrad needs it, X's
columnwise copy; it keeps what its own backward reads.

===========  ===============================  ==============================  ===============================
stage        inputs                           X (quantized in one kernel)     saved by the stage
===========  ===============================  ==============================  ===============================
``Plain``    ``x [..., K]``                   ``x``                           nothing (or ``x``: ``keep_input``)
``Norm``     ``x [..., K]``, gamma, beta      ``norm(x)``, never written      ``x``, gamma, row mean / rstd
``Swiglu``   ``h [..., 2K]`` = ``[gate|up]``  ``silu(gate) * up``             ``h``
            (weighted: and ``probs [...]``)   (weighted: ``* probs`` per row)  (weighted: and ``probs``)
===========  ===============================  ==============================  ===============================

Every stage runs with either layout (``layouts.py``), except ``Norm`` (dense only) and the weighted ``Swiglu``
(grouped only: Megatron's grouped experts scale each token's activation by its routing probability).

``Norm`` and ``Swiglu`` give the same bits, outputs and gradients, as ``normalization.norm`` or
``swiglu.swiglu`` followed by the plain op (their kernels compute the same fp32 math, ``docs/NUMERICS.md``).
"""

from __future__ import annotations

import torch

from ..backends import Backend
from ..recipe import QuantParams


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [..., width]`` as a contiguous ``[rows, width]`` (a view where it can be one)."""
    t2d = t.reshape(-1, width)
    return t2d if t2d.is_contiguous() else t2d.contiguous()


class Plain:
    """X is the op's input ``x [..., K]``.

    ``keep_input=True``: ``x``'s storage is saved by another autograd node anyway (``mark_saved_elsewhere``): the
    op then saves ``x`` itself (no new bytes) instead of its columnwise copy and quantizes that copy again in
    backward with forward's own kernel call, the same bits. Only for a contiguous ``x`` (else a copy would be kept).
    """

    num_inputs = 1

    def __init__(self, keep_input: bool = False) -> None:
        self.keep_input = keep_input

    def input_features(self, inputs) -> int:
        return inputs[0].shape[-1]

    def requantizes(self, inputs, need_wgrad: bool) -> bool:
        """Whether wgrad's columnwise copy is made again in backward (``keep_input``) instead of saved."""
        return need_wgrad and self.keep_input and inputs[0].is_contiguous()

    def forward(self, backend: Backend, layout, params: QuantParams, inputs, *, columnwise: bool, requantize: bool):
        x = inputs[0]
        x2d = as_rows(x, x.shape[-1])
        xq = layout.quantize_act(backend, x2d, params, rowwise=True, columnwise=columnwise)
        return xq, ((x2d,) if requantize else ()), x.shape

    def columnwise_again(self, backend: Backend, layout, params: QuantParams, saved):
        """wgrad's columnwise copy from the kept input: forward's own call (both copies, the rowwise one dropped)."""
        return layout.quantize_act(backend, saved[0], params, rowwise=True, columnwise=True)

    def backward(self, backend: Backend, d_x2d, saved, shape, needs) -> tuple:
        return (None if d_x2d is None else d_x2d.view(shape),)


class Norm:
    """X = LayerNorm or RMSNorm of ``x [..., K]`` with scale ``gamma [K]`` (and ``beta [K]``, LayerNorm), computed
    and quantized in one kernel after the row statistics (the high-precision norm output is never written)."""

    num_inputs = 3

    def __init__(self, normalization: str, eps: float) -> None:
        self.normalization, self.eps = normalization, float(eps)

    def input_features(self, inputs) -> int:
        return inputs[0].shape[-1]

    def requantizes(self, inputs, need_wgrad: bool) -> bool:
        return False

    def forward(self, backend: Backend, layout, params: QuantParams, inputs, *, columnwise: bool, requantize: bool):
        if layout.grouped:
            raise NotImplementedError("the fused norm stage has no grouped (mixture-of-experts) form")
        x, gamma, beta = inputs
        x2d = as_rows(x, x.shape[-1])
        xq, mean, rstd = backend.quantize_norm_act(x2d, gamma, beta, self.eps, self.normalization, params,
                                                   rowwise=True, columnwise=columnwise)  # fmt: skip
        return xq, (x2d, gamma, mean, rstd), x.shape

    def backward(self, backend: Backend, d_normed, saved, shape, needs) -> tuple:
        if d_normed is None:
            return None, None, None
        x2d, gamma, mean, rstd = saved
        dx, dgamma, dbeta = backend.norm_bwd(d_normed, x2d, gamma, mean, rstd, need_dgamma=needs[1], need_dbeta=needs[2])
        return (dx.view(shape) if needs[0] else None), dgamma, dbeta


class Swiglu:
    """X = ``silu(gate) * up`` of fc1's output ``h [..., 2K] = [gate | up]`` (Megatron's gated layout), computed and
    quantized in one kernel (the activation is never written); its backward is recomputed from ``h``.

    ``weighted=True``: a second input ``probs`` (one weight per row of ``h``, any shape of that many elements; fp32,
    bf16 or fp16) scales each row: X = ``(act * probs[:, None]).to(h.dtype)`` (``reference_fused.weight_rows``),
    what Megatron's ``TEGroupedMLP`` feeds fc2 (``act(fc1) * permuted_probs``). Its backward gives what autograd
    gives for that composition: ``g = dX`` in the product's dtype, ``d_act = (g * probs).to(h.dtype)``, ``d_probs =
    (g * act).sum(-1)`` (torch's reduction, on ``act`` recomputed from ``h``) in probs' dtype."""

    def __init__(self, weighted: bool = False) -> None:
        self.weighted = weighted
        self.num_inputs = 2 if weighted else 1

    def input_features(self, inputs) -> int:
        return inputs[0].shape[-1] // 2

    def requantizes(self, inputs, need_wgrad: bool) -> bool:
        return False

    def forward(self, backend: Backend, layout, params: QuantParams, inputs, *, columnwise: bool, requantize: bool):
        h = inputs[0]
        h2d = as_rows(h, h.shape[-1])
        probs = as_rows(inputs[1], 1).view(-1) if self.weighted else None
        xq = layout.quantize_swiglu_act(backend, h2d, params, rowwise=True, columnwise=columnwise, probs=probs)
        return xq, ((h2d, inputs[1]) if self.weighted else (h2d,)), h.shape

    def backward(self, backend: Backend, d_act, saved, shape, needs) -> tuple:
        if d_act is None:
            return (None,) * self.num_inputs
        h2d = saved[0]
        if not self.weighted:
            return (backend.swiglu_bwd(d_act, h2d).view(shape),)
        probs = saved[1].reshape(-1, 1)
        g = d_act.to(torch.promote_types(h2d.dtype, probs.dtype))  # the gradient of Megatron's ``.to(h.dtype)``
        dh = backend.swiglu_bwd((g * probs).to(h2d.dtype), h2d).view(shape) if needs[0] else None
        d_probs = None
        if needs[1]:
            d_probs = (g * backend.swiglu_fwd(h2d)).sum(-1, keepdim=True).to(probs.dtype).view(saved[1].shape)
        return dh, d_probs
