"""The combine of an MoE layer's permuted tokens back into token order, in one pass: token ``t``'s output is the
sum of its permuted rows (each times its routing probability, rounded to the product's dtype, where given), added in
fp32 in the order of the permuted rows, rounded once to the product's dtype and cast to the rows' dtype: what
Megatron's ``unpermute`` computes (a ``scatter_add`` / ``index_add`` of ``y * probs`` into zeros of the product's
dtype, then a cast), bit for bit where torch accumulates each output in fp32 in that order (the CPU's
expanded-index ``scatter_add``; ``index_add_`` on a GPU under ``torch.use_deterministic_algorithms``; the GPU's
default ``scatter_add`` adds with atomics in any order).

``row_of [E * T]`` (int32) holds, at ``e * T + t``, the permuted row of token ``t``'s copy for expert ``e``, -1 where
token ``t`` is not routed to ``e``: a program walks the experts in order, so it meets a token's rows in increasing
permuted order (the permutation is expert-major). The kernels compile without FMA contraction (``FP_OPTIONS``):
the product and the sum round on their own, as torch's separate ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_math import FP_OPTIONS
from .launch import FastLauncher

BLOCK_H = 256


@triton.jit
def _round(v, ACC: tl.constexpr):
    """``v`` (fp32) rounded to the accumulation dtype (0 fp32, 1 bf16, 2 fp16), returned in fp32."""
    if ACC == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif ACC == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def unpermute_kernel(y_ptr, row_of_ptr, probs_ptr, out_ptr, T, E, H, ACC: tl.constexpr, HAS_PROBS: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    entry = row_of_ptr + t.to(tl.int64)
    for _ in range(0, E):
        row = tl.load(entry)
        entry += T
        if row >= 0:
            v = tl.load(y_ptr + row.to(tl.int64) * H + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_PROBS:
                v = _round(v * tl.load(probs_ptr + row).to(tl.float32), ACC)
            acc += v
    tl.store(out_ptr + t.to(tl.int64) * H + cols, _round(acc, ACC).to(out_ptr.dtype.element_ty), mask=ok)


_launch = FastLauncher(unpermute_kernel)
ACC_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def unpermute(y: torch.Tensor, row_of: torch.Tensor, num_tokens: int, probs: torch.Tensor | None,
              acc_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``out [num_tokens, H]`` in y's dtype from the permuted rows ``y [N, H]`` (contiguous), ``row_of`` int32
    ``[E * num_tokens]`` (module docstring), ``probs [N]`` or None; sums accumulated in ``acc_dtype``."""
    n, h = y.shape
    out = torch.empty(num_tokens, h, dtype=y.dtype, device=y.device)
    e = row_of.numel() // max(num_tokens, 1)
    if num_tokens and h:
        grid = (num_tokens, triton.cdiv(h, BLOCK_H))
        _launch(grid, y, row_of, probs if probs is not None else y, out, num_tokens, e, h, ACC_CODES[acc_dtype],
                probs is not None, BLOCK_H, num_warps=4, **FP_OPTIONS)  # fmt: skip
    return out
