"""Which AMD gfx950 (MI355X) FlyDSL kernel runs a call, and with which tile: the one place that decides.

Each FlyDSL kernel states once what it takes (``gemm.unsupported_reason``; ``gemm_lds.weight_fits`` and
``gemm_lds.wgrad_fits``); the functions here consult it and answer None (or False) for every call it does
not take, which then runs the portable Triton kernel (kernels/triton/, compiled for gfx950 too). The
``flydsl`` backend (``backends/flydsl.py``) calls these functions, then the kernel they name.

Weights: an E4M3 weight [N, K] with N, K multiples of 128 is quantized straight into FlyDSL's (16, 16)
preshuffled layout (W and W^T in one pass); fprop and dgrad read it with the LDS-staged kernels
(``gemm_lds.py``). Other weights stay K-major and take the direct-load kernel (``gemm.py``) or the
portable GEMM. Compile-only here (docs/AMD.md): the tiles are chosen from the AOT ISA (registers, LDS,
instruction mix), not timed.
"""

from __future__ import annotations

import torch

from ...recipe import QuantParams
from ...tensor import BlockwiseFp8Tensor
from . import gemm, gemm_lds
from .gemm_lds import TileConfig

E4M3 = torch.float8_e4m3fn

# fprop/dgrad: 4 waves along M (x 1 or 2 along N), each owning 32 rows x 128 columns of 16-wide strips
FWD_128x128 = TileConfig(128, 128, 4, "preshuffle16", waves_m=4, b_stages=1, unroll=4, burst=True)
FWD_128x256 = TileConfig(128, 256, 8, "preshuffle16", waves_m=4, b_stages=1, unroll=4, burst=True)
WGRAD_256x128 = TileConfig(256, 128, 8, "k_major", waves_m=4, burst=True)


def fwd_config(n_out: int) -> TileConfig:
    """fprop/dgrad tile for an output of ``n_out`` columns: 128x256 (8 waves) where it divides, else 128x128."""
    return FWD_128x256 if n_out % FWD_128x256.bn == 0 else FWD_128x128


def preshuffled_weight(w: torch.Tensor, params: QuantParams) -> bool:
    """Whether ``w [N, K]`` is quantized into the preshuffled layout (for the LDS kernels): E4M3, N and K
    multiples of 128, not an fp32 weight on a GPU (the preshuffle quantizer refuses those; the K-major copy
    has the same numerics)."""
    fp32_gpu = w.dtype == torch.float32 and w.is_cuda
    return params.fp8_dtype == E4M3 and gemm_lds.weight_fits(*w.shape) and not fp32_gpu


def lds_fwd(x: BlockwiseFp8Tensor, w: BlockwiseFp8Tensor) -> TileConfig | None:
    """The LDS kernel's tile for fprop on a preshuffled ``w [N, K]``, or None for an E5M2 ``x`` (HYBRID: the
    portable GEMM on ``w``'s K-major copy; correct, not fast)."""
    return fwd_config(w.shape[0]) if x.fp8_dtype == E4M3 else None


def lds_dgrad(dy: BlockwiseFp8Tensor, k: int, padded: bool) -> TileConfig | None:
    """The LDS kernel's tile for dgrad on a preshuffled W^T of ``k`` rows (``padded``: stored padded to a
    multiple of 256 rows, ``gemm_lds.dgrad_operands``: the 128x256 tile covers the padding), or None for an
    E5M2 ``dy`` (HYBRID gradients: the portable GEMM on the K-major copy; correct, not fast)."""
    if dy.fp8_dtype != E4M3:
        return None
    return FWD_128x256 if padded else fwd_config(k)


def lds_wgrad(dy: BlockwiseFp8Tensor, x: BlockwiseFp8Tensor) -> TileConfig | None:
    """The LDS kernel's tile for wgrad ``dW [N, K] = dY^T X`` (K-major operands), or None where the direct or
    portable GEMM runs it."""
    n, k, tokens = dy.shape[1], x.shape[1], dy.shape[0]
    e4m3 = dy.fp8_dtype == E4M3 and x.fp8_dtype == E4M3
    return WGRAD_256x128 if e4m3 and gemm_lds.wgrad_fits(WGRAD_256x128, n, k, tokens) else None


def direct_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the direct-load kernel (``gemm.py``) runs ``a @ b^T`` on K-major operands (else the portable
    GEMM)."""
    return gemm.unsupported_reason(a, b) is None
