"""The combine of an MoE layer's permuted tokens back into token order, in one pass: token ``t``'s output is the
sum of its permuted rows (each times its routing probability, rounded to the product's dtype, where given), added in
fp32 in the order of the permuted rows, rounded once to the product's dtype and cast to the rows' dtype: what
Megatron's ``unpermute`` computes (a ``scatter_add`` / ``index_add`` of ``y * probs`` into zeros of the product's
dtype, then a cast), bit for bit where torch accumulates each output in fp32 in that order (the CPU's
expanded-index ``scatter_add``; ``index_add_`` on a GPU under ``torch.use_deterministic_algorithms``; the GPU's
default ``scatter_add`` adds with atomics in any order).

A program reads token ``t``'s rows from ``token_rows[token_offsets[t] : token_offsets[t + 1]]`` (int32, each token's
rows in increasing permuted order): top-k dependent loads per token, not one per expert. Without probabilities the
same kernel is the permutation's backward (``index_add_`` of the rows into their tokens, which the CPU sums in fp32 in
row order and rounds once; on a GPU ``index_add_`` adds with atomics in any order). The kernels compile without FMA
contraction (``FP_OPTIONS``): the product and the sum round on their own, as torch's separate ops do.
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
def unpermute_kernel(y_ptr, rows_ptr, offsets_ptr, probs_ptr, out_ptr, H, ACC: tl.constexpr, HAS_PROBS: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(tl.load(offsets_ptr + t), tl.load(offsets_ptr + t + 1)):
        row = tl.load(rows_ptr + j)
        v = tl.load(y_ptr + row.to(tl.int64) * H + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_PROBS:
            v = _round(v * tl.load(probs_ptr + row).to(tl.float32), ACC)
        acc += v
    tl.store(out_ptr + t.to(tl.int64) * H + cols, _round(acc, ACC).to(out_ptr.dtype.element_ty), mask=ok)


_launch = FastLauncher(unpermute_kernel)
ACC_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def unpermute(y: torch.Tensor, token_rows: torch.Tensor, token_offsets: torch.Tensor, probs: torch.Tensor | None,
              acc_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``out [T, H]`` in y's dtype from the permuted rows ``y [N, H]`` (contiguous), ``token_rows [N]`` and
    ``token_offsets [T + 1]`` int32 (module docstring), ``probs [N]`` or None; sums rounded to ``acc_dtype``."""
    if token_rows.dtype != torch.int32 or token_offsets.dtype != torch.int32:
        raise TypeError(f"token_rows and token_offsets must be int32, got {token_rows.dtype} and {token_offsets.dtype}")
    num_tokens, h = token_offsets.numel() - 1, y.shape[1]
    out = torch.empty(num_tokens, h, dtype=y.dtype, device=y.device)
    if num_tokens and h:
        grid = (num_tokens, triton.cdiv(h, BLOCK_H))
        _launch(grid, y, token_rows, token_offsets, probs if probs is not None else y, out, h, ACC_CODES[acc_dtype],
                probs is not None, BLOCK_H, num_warps=4, **FP_OPTIONS)  # fmt: skip
    return out
