"""Exact float conversions for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

As shipped (triton 3.6), the interpreter converts floats bit by bit and gets RNE wrong: fp32/bf16
-> fp8 rounds ties away from zero and loses carries (124.3 -> 64), subnormals come out wrong, and
fp32 -> bf16 truncates (triton issue #8322). Routing conversions between the dtypes torch knows
through torch's round-to-nearest-even casts makes the interpreter match the GPU bit for bit
(the kernels' products never exceed the FP8 maximum by more than one fp32 ulp, which RNE rounds to
the maximum — scales.py — so saturation never matters).

It also gives ``tl.maximum``/``tl.minimum`` the GPU's NaN semantics: as shipped, the interpreter
maps both the NaN-ignoring (``max.f32``, the default) and the NaN-propagating (``max.NaN.f32``,
``propagate_nan=ALL``) forms to ``np.maximum``, so a kernel that lost its NaN propagation would still
pass on the CPU. And it reduces with ``scales.max_nan`` through numpy at once (NaN-propagating
``np.max``) instead of the interpreter's element-by-element Python loop for user combine functions,
which made every quantization in the CPU tests several times slower.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

_TORCH_DTYPES = {
    tl.float32: torch.float32,
    tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e5: torch.float8_e5m2,
}
_INT_OF_WIDTH = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
_NP_OF_WIDTH = {8: np.uint8, 16: np.uint16, 32: np.uint32}

_applied = False


def apply() -> None:
    """Patch ``triton.runtime.interpreter._convert_float`` once (no-op when already patched)."""
    global _applied
    if _applied:
        return
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = _TORCH_DTYPES.get(input_dtype), _TORCH_DTYPES.get(output_dtype)
        if src is None or dst is None:
            return original(input, input_dtype, output_dtype, rounding_mode)
        in_bits = np.ascontiguousarray(input).view(_NP_OF_WIDTH[input_dtype.primitive_bitwidth])
        signed = torch.from_numpy(in_bits.astype(in_bits.dtype.newbyteorder("="), copy=False))
        as_int = signed.view(_INT_OF_WIDTH[input_dtype.primitive_bitwidth])
        out = as_int.view(src).to(dst).view(_INT_OF_WIDTH[output_dtype.primitive_bitwidth]).numpy()
        return out.view(_NP_OF_WIDTH[output_dtype.primitive_bitwidth]).reshape(np.shape(input))

    interpreter._convert_float = convert_float
    builder = interpreter.InterpreterBuilder
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)

    from .scales import max_nan

    generic = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is max_nan:
            return self.min_max(input[0], val_reduce_op=np.max)  # np.max propagates NaN, as max.NaN.f32
        return generic(self, input)

    interpreter.ReduceOps.apply_impl = apply_impl
    _applied = True
