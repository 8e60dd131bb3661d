"""Input checks at the public boundary of the FP8 ops: one place for what every op refuses, with messages that say
what to do. Cheap on the hot path: C-level passes over expert lists, no host synchronisation."""

from __future__ import annotations

import operator

import torch

from ..tensor import HIGH_PRECISION_DTYPES

_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")


def _dtype_fix(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "use torch.nn.Linear for complex weights"
    return "convert it, e.g. layer.to(torch.bfloat16)"


def check_input(x, what: str = "input") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{what} has dtype {x.dtype}; FP8 blockwise linears take bfloat16, float16 or float32 "
                        "(convert with .to(torch.bfloat16))")  # fmt: skip
    if x.dim() < 1:
        raise ValueError(f"{what} must have at least one dim (the features), got a scalar")


def check_weights(weights, in_features: int, device: torch.device, *, each: bool = True) -> None:
    """``weights``: one or more 2-D ``[N, in_features]`` tensors of one shape on ``device`` in bf16/fp16/fp32.
    ``each=False`` checks weight 0 only (a grouped weight cache checks every expert whenever it quantizes and
    serves its copies only while every weight's shape, dtype and storage are the ones it checked)."""
    if not weights:
        raise ValueError("an FP8 linear needs at least one weight")
    w0 = weights[0]
    if not isinstance(w0, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(w0).__name__}")
    grouped = len(weights) > 1
    name = "weight 0" if grouped else "weight"
    if w0.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} has dtype {w0.dtype}; FP8 blockwise linears take bfloat16, float16 or float32 weights: "
                        f"{_dtype_fix(w0.dtype)}")  # fmt: skip
    if w0.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out_features, in_features], got shape {tuple(w0.shape)}")
    if w0.shape[1] != in_features:
        raise ValueError(f"the input's last dim is {in_features} but in_features is {w0.shape[1]}")
    if w0.device != device:
        raise ValueError(f"the input is on {device} but the weight is on {w0.device}")
    if not (grouped and each):
        return
    if set(map(_shape_of, weights)) == {w0.shape} and set(map(_device_of, weights)) == {device} and set(
        map(_dtype_of, weights)
    ) == {w0.dtype}:
        return
    n, k = w0.shape
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) != (n, k) or w.device != device:
            desc = f"{tuple(w.shape)} on {w.device}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"weight {i} is {desc}: each expert needs a [{n}, {k}] weight on {device}")
        if w.dtype != w0.dtype:
            raise TypeError(f"weight {i} is {w.dtype} but weight 0 is {w0.dtype}: experts share one dtype")


def check_stacked_weight(w, in_features: int, device: torch.device) -> None:
    """``w``: the experts' weights as one ``[E, N, in_features]`` tensor (``E >= 1``) on ``device`` in bf16/fp16/fp32."""
    if w.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"the stacked expert weights have dtype {w.dtype}; FP8 blockwise linears take bfloat16, float16 or "
                        f"float32 weights: {_dtype_fix(w.dtype)}")  # fmt: skip
    if w.dim() != 3 or w.shape[0] == 0:
        raise ValueError("expert weights given as one tensor must be 3-D [experts, out_features, in_features] with at "
                         f"least one expert, got shape {tuple(w.shape)}")  # fmt: skip
    if w.shape[2] != in_features:
        raise ValueError(f"the input's last dim is {in_features} but in_features is {w.shape[2]}")
    if w.device != device:
        raise ValueError(f"the input is on {device} but the weights are on {w.device}")


def check_biases(biases, num_weights: int, out_features: int, device: torch.device) -> None:
    if biases is None:
        return
    if len(biases) != num_weights or any(map(operator.is_, biases, [None] * len(biases))):
        raise ValueError(f"biases must be one [{out_features}] tensor per weight ({num_weights}), got {len(biases)}")
    shapes, devices, dtypes = set(map(_shape_of, biases)), set(map(_device_of, biases)), set(map(_dtype_of, biases))
    if shapes != {torch.Size((out_features,))} or devices != {device}:
        b = biases[0] if len(biases) == 1 else None
        got = f"{tuple(b.shape)} on {b.device}" if b is not None else f"shapes {sorted(map(tuple, shapes))} on {devices}"
        raise ValueError(f"bias must be [{out_features}] on {device}, got {got}")
    if not dtypes <= set(HIGH_PRECISION_DTYPES):
        raise TypeError(f"bias has dtype {dtypes}; FP8 blockwise linears take bfloat16, float16 or float32 biases")


def check_trainable_weights(inputs, weights, biases) -> None:
    """Inference tensors (made or loaded under ``torch.inference_mode()``) cannot be saved by autograd."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or not weights[0].is_inference():
        return
    if any(t is not None and t.requires_grad for t in (*inputs, *weights, *(biases or ()))):
        raise RuntimeError(
            "the weight is an inference tensor (made or loaded under torch.inference_mode()), which autograd cannot "
            "save for backward: build or load the layer outside inference_mode to train it, or run this forward under "
            "torch.no_grad() or torch.inference_mode()"
        )
