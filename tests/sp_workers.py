"""Worker processes of tests/test_sequence_parallel.py: each rank runs the sequence-parallel FP8 linears and the
plain way (bf16 all-gather, then the FP8 linear) on the same shards and checks they agree bit for bit."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from primus_fp8_plugin import fp8_blockwise_linear, fp8_norm_linear
from primus_fp8_plugin.normalization import norm
from primus_fp8_plugin.ops import gather_rows
from tools.sp_saved_bytes import SavedBytes

from .conftest import make_input as _make_input

# set by ``run``: where the ranks compute (the GPU test runs the same checks on cuda:rank with NCCL)
DEVICE, BACKEND = "cpu", "reference"


def make_input(*args, **kw):
    return _make_input(*args, **kw).to(DEVICE)


# (s_local, batch, K, N, bias, main_grad, frozen weight, fp8_format): rows s_local*batch
CASES = [
    (64, 2, 320, 200, True, False, False, "E4M3"),  # 128 rows per rank, ragged K and N
    (256, 1, 256, 136, False, True, False, "HYBRID"),  # 256 rows, main_grad accumulation
    (50, 3, 384, 128, True, False, False, "E4M3"),  # 150 rows: columnwise tiles straddle ranks -> bf16 gather
    (50, 3, 384, 128, True, False, True, "E4M3"),  # 150 rows, frozen weight: rowwise only, FP8 gather
    (1, 128, 128, 64, False, False, False, "E4M3"),  # one token per rank, 128 sequences
]


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_same(a, b, what):
    assert (a is None) == (b is None), f"{what}: one side is None"
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(bits(a), bits(b)), f"{what}: bits differ (max |diff| {(a.float() - b.float()).abs().max()})"


def _leaves(rank, s, b, k, n, bias, main_grad, frozen, seed):
    x = make_input((s, b, k), seed=seed + rank, spread=True).requires_grad_(True)
    w = (make_input((n, k), seed=seed + 100 + rank, spread=False) / 16).requires_grad_(not frozen)
    if main_grad:
        w.main_grad = make_input((n, k), dtype=torch.float32, seed=seed + 200, spread=False)
        w.grad_added_to_main_grad = False
    bb = make_input((n,), seed=seed + 300 + rank, spread=False).requires_grad_(True) if bias else None
    return x, w, bb


def _run(fn, x, w, bb, dy):
    with SavedBytes() as saved:
        y = fn(x, w, bb)
    y.backward(dy)
    mg = w.main_grad.clone() if hasattr(w, "main_grad") else None
    return y.detach(), x.grad, w.grad, mg, None if bb is None else bb.grad, saved.nbytes


def check_linear(rank, world, case, seed):
    s, b, k, n, bias, main_grad, frozen, fmt = case
    from primus_fp8_plugin import BlockwiseRecipe

    recipe = BlockwiseRecipe(fp8_format=fmt)
    dy = make_input((world * s, b, n), seed=seed + 400 + rank, spread=True)
    kw = dict(recipe=recipe, backend=BACKEND)
    leaves = (rank, s, b, k, n, bias, main_grad, frozen, seed)
    sp = dict(kw, sequence_parallel_group=dist.group.WORLD)
    new = _run(lambda x, w, bb: fp8_blockwise_linear(x, w, bb, **sp), *_leaves(*leaves), dy)
    old = _run(lambda x, w, bb: fp8_blockwise_linear(gather_rows(x), w, bb, **kw), *_leaves(*leaves), dy)
    for what, a, c in zip(("y", "dx", "dW", "main_grad", "db"), new[:5], old[:5]):
        if what == "dW" and main_grad:  # Megatron's placeholder (uninitialised): the gradient is in main_grad
            assert a.shape == c.shape == (n, k)
        else:
            check_same(a, c, f"{case} {what}")
    m = s * b
    local_col = k * m + 4 * (m // 128) * (-(-k // 4) * 4)  # FP8 [K, m] + fp32 [m/128, pad4(K)]
    if frozen:
        assert new[5] == 0, f"{case}: saved {new[5]} bytes for a frozen weight"
    elif m % 128 == 0:
        assert new[5] == local_col, f"{case}: saved {new[5]} bytes, expected the local shard's {local_col}"
        assert old[5] >= world * k * m, f"{case}: the plain way saved {old[5]} bytes"
    else:  # the bf16 fallback saves what the plain way saves
        assert new[5] == old[5], f"{case}: fallback saved {new[5]} vs {old[5]} bytes"


def check_norm_linear(rank, world, normalization, zero_centered, s, b, seed):
    k, n = 256, 192
    x, w, bb = _leaves(rank, s, b, k, n, True, False, False, seed)
    g = torch.Generator().manual_seed(seed)
    gamma = (torch.rand(k, generator=g) + 0.5).bfloat16().to(DEVICE).requires_grad_(True)
    beta = torch.randn(k, generator=g).bfloat16().to(DEVICE).requires_grad_(True) if normalization == "LayerNorm" else None
    dy = make_input((world * s, b, n), seed=seed + 400 + rank, spread=True)
    args = dict(normalization=normalization, eps=1e-5, zero_centered_gamma=zero_centered)
    results = []
    for fused in (True, False):
        xs, ws, bs = (t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, bb))
        gs = gamma.detach().clone().requires_grad_(True)
        be = None if beta is None else beta.detach().clone().requires_grad_(True)
        if fused:
            y = fp8_norm_linear(xs, gs, be, ws, bs, sequence_parallel_group=dist.group.WORLD, backend=BACKEND, **args)
        else:
            normed = norm(xs, normalization, gs, be, 1e-5, zero_centered, backend=BACKEND)
            y = fp8_blockwise_linear(gather_rows(normed), ws, bs, backend=BACKEND)
        y.backward(dy)
        results.append((y.detach(), xs.grad, ws.grad, bs.grad, gs.grad, None if be is None else be.grad))
    for what, a, c in zip(("y", "dx", "dW", "db", "dgamma", "dbeta"), *results):
        check_same(a, c, f"norm_linear {normalization} {what}")


def has_fused_norm(backend: str) -> bool:
    """Whether the backend has the fused norm + quantization kernels (cuBLAS and Hopper GEMM backends do not)."""
    from primus_fp8_plugin.backends import get_backend
    from primus_fp8_plugin.backends.base import Backend

    return type(get_backend(backend, torch.device(DEVICE))).quantize_norm_act is not Backend.quantize_norm_act


def run(rank, world, port, seed, device="cpu", backend="reference"):
    """Every check on this rank: gloo on the CPU, or (``device="cuda"``) NCCL on ``cuda:rank``."""
    global DEVICE, BACKEND
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    DEVICE, BACKEND = (f"cuda:{rank}" if device == "cuda" else "cpu"), backend
    dist_backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(dist_backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for case in CASES:
            check_linear(rank, world, case, seed)
        if has_fused_norm(BACKEND):
            check_norm_linear(rank, world, "RMSNorm", False, 128, 1, seed)
            check_norm_linear(rank, world, "LayerNorm", True, 64, 2, seed)
            check_norm_linear(rank, world, "LayerNorm", False, 70, 1, seed)  # bf16 gather of the normed shard
        # no gradients at all: the forward alone (no columnwise copy), any rows
        with torch.no_grad():
            x, w, bb = _leaves(rank, 3, 5, 256, 128, True, False, False, seed)
            check_same(fp8_blockwise_linear(x, w, bb, sequence_parallel_group=dist.group.WORLD, backend=BACKEND),
                       fp8_blockwise_linear(gather_rows(x), w, bb, backend=BACKEND), "no_grad y")  # fmt: skip
    finally:
        dist.destroy_process_group()
