"""The Gluon grouped GEMMs (kernels/sm90/gemm_grouped.py) on a Hopper GPU: bit for bit a loop of the dense
Gluon GEMM per expert and the portable grouped kernels (kernels/triton/gemm_grouped.py), for fwd (with and without bias),
dgrad (E4M3 and HYBRID's E5M2 dY) and wgrad (into new tensors, and accumulated into random main_grads), on
random data and ragged routings with counts 0, 1, 127, 128, 129, skewed, 1 to 64 experts, device-side counts.
Skipped without an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.grouped import group_layout, quantize_activation_grouped, quantize_weight_grouped
from primus_fp8_plugin.kernels.sm90 import heuristics as H
from primus_fp8_plugin.kernels.sm90.gemm import blockwise_gemm_gluon
from primus_fp8_plugin.kernels.sm90.gemm_grouped import grouped_gemm_gluon, grouped_wgrad_gluon
from primus_fp8_plugin.kernels.sm90.target import GluonUnsupported
from primus_fp8_plugin.kernels.triton.gemm_grouped import grouped_gemm, grouped_wgrad
from primus_fp8_plugin.recipe import BLOCK

from ..conftest import make_input

pytestmark = pytest.mark.gpu

COPIES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def gluon_fwd(a, a_s, b, b_s, layout, *, out_dtype, bias=None):
    """The Gluon grouped fwd/dgrad with the config the heuristics pick for its N."""
    return grouped_gemm_gluon(a, a_s, b, b_s, layout, out_dtype=out_dtype, config=H.grouped_fwd_config(b.shape[1]),
                              bias=bias)  # fmt: skip


def gluon_wgrad(a, a_s, b, b_s, layout, *, out_dtype, accumulate_into=None):
    """The Gluon grouped wgrad with the heuristics' config (into main_grad: the config kept for direct calls;
    the heuristics send that case to the portable kernel)."""
    return grouped_wgrad_gluon(a, a_s, b, b_s, layout, out_dtype=out_dtype,
                               config=H.grouped_wgrad_config(accumulate_into is not None),
                               accumulate_into=accumulate_into)  # fmt: skip


def dense_gluon(a, a_s, b, b_s, *, b_block_dim, out_dtype, bias=None, accumulate_into=None):
    """The dense Gluon GEMM with the tile the heuristics pick."""
    acc = accumulate_into is not None
    cfg = H.gemm_config(b_block_dim, torch.float32 if acc else out_dtype, acc, bias is not None)
    return blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=b_block_dim, out_dtype=out_dtype, config=cfg, bias=bias,
                                accumulate_into=accumulate_into)  # fmt: skip


def _hopper() -> bool:
    if not torch.cuda.is_available() or torch.version.hip:
        return False
    return torch.cuda.get_device_capability()[0] == 9


requires_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon grouped GEMMs need an NVIDIA sm_90 GPU")


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def skewed(num_experts: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, num_experts + 1).float() ** 1.3
    p = p[torch.randperm(num_experts, generator=g)]
    counts = (p / p.sum() * tokens).floor().long()
    counts[counts < 3] = 0
    counts[int(p.argmax())] += tokens - int(counts.sum())
    return counts.tolist()


def ragged(num_experts: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0, 1, 127, 128, 129, 255, 256, 300, 17, 640])
    return pool[torch.randint(0, len(pool), (num_experts,), generator=g)].tolist()


ROUTINGS = [  # name, counts, K, N (fwd: [T, K] x [N, K]^T; wgrad: dW [N, K])
    ("edges", [0, 1, 127, 128, 129, 0, 1000, 5], 1024, 768),
    ("one-expert", [333], 512, 256),
    ("one-empty", [0], 512, 256),
    ("first-empty-then-all", [0, 0, 700], 256, 1024),
    ("ragged-13", ragged(13, 1), 528, 640),  # K % 128 != 0, N % 256 != 0, N % 128 != 0
    ("skewed-64", skewed(64, 6000, 0), 512, 1536),
    ("ragged-64", ragged(64, 2), 256, 384),
]


def _case(counts, k, n, fmt, seed=0):
    recipe = BlockwiseRecipe(fp8_format=fmt)
    p = [recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)]
    t = sum(counts)
    x = make_input((t, k), seed=seed + 1).cuda()
    dy = make_input((t, n), seed=seed + 2).cuda()
    ws = make_input((len(counts), n, k), seed=seed + 3, spread=False).cuda()
    bias = make_input((len(counts), n), seed=seed + 4, spread=False).cuda()
    return x, dy, ws, bias, p


def _quantized(x, dy, ws, counts, p, device_counts):
    layout = group_layout(torch.tensor(counts, device="cuda") if device_counts else counts, x.shape[0], "cuda")
    xq = quantize_activation_grouped(x, layout, p[0], backend="triton")
    dyq = quantize_activation_grouped(dy, layout, p[2], backend="triton")
    wq = quantize_weight_grouped(ws, p[1], backend="triton")
    return layout, xq, dyq, wq


def _segments(counts):
    off = poff = 0
    for e, c in enumerate(counts):
        pc = -(-c // BLOCK) * BLOCK
        yield e, c, off, poff, pc
        off, poff = off + c, poff + pc


@requires_hopper
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("name, counts, k, n", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_fwd_dgrad_equal_dense_gluon_loop_and_portable(name, counts, k, n, fmt):
    x, dy, ws, bias, p = _case(counts, k, n, fmt)
    for device_counts in (True, False):
        layout, xq, dyq, wq = _quantized(x, dy, ws, counts, p, device_counts)
        fwd = (xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, layout)
        dgrad = (dyq.rowwise_data, dyq.rowwise_scale_inv, wq.columnwise_data, wq.columnwise_scale_inv, layout)
        got = {
            "y": gluon_fwd(*fwd, out_dtype=torch.bfloat16, bias=bias),
            "y0": gluon_fwd(*fwd, out_dtype=torch.bfloat16),
            "y16": gluon_fwd(*fwd, out_dtype=torch.float16, bias=bias.half()),
            "dx": gluon_fwd(*dgrad, out_dtype=torch.bfloat16),
        }
        portable = {
            "y": grouped_gemm(*fwd, out_dtype=torch.bfloat16, bias=bias),
            "y0": grouped_gemm(*fwd, out_dtype=torch.bfloat16),
            "y16": grouped_gemm(*fwd, out_dtype=torch.float16, bias=bias.half()),
            "dx": grouped_gemm(*dgrad, out_dtype=torch.bfloat16),
        }
        for key in got:
            assert same(got[key], portable[key]), f"{key} differs from the portable grouped kernel ({name})"
        assert got["y"].abs().sum() > 0 or sum(counts) == 0
        xs, dys = xq.split(), dyq.split()
        for e, c, off, _, _ in _segments(counts):
            if c == 0:
                continue
            w = wq.expert(e)
            dense = {
                "y": dense_gluon(xs[e].rowwise_data, xs[e].rowwise_scale_inv, w.rowwise_data,
                                          w.rowwise_scale_inv, b_block_dim=2, out_dtype=torch.bfloat16, bias=bias[e]),
                "dx": dense_gluon(dys[e].rowwise_data, dys[e].rowwise_scale_inv, w.columnwise_data,
                                           w.columnwise_scale_inv, b_block_dim=2, out_dtype=torch.bfloat16),
            }  # fmt: skip
            for key in dense:
                assert same(got[key][off : off + c], dense[key]), f"{key}, expert {e} (count {c}) vs the dense loop"


@requires_hopper
@pytest.mark.parametrize("fmt, span", [("E4M3", True), ("E4M3", False), ("HYBRID", True)],
                         ids=["E4M3-one-buffer", "E4M3-separate", "HYBRID-one-buffer"])  # fmt: skip
@pytest.mark.parametrize("name, counts, k, n", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_wgrad_equal_dense_gluon_loop_and_portable(name, counts, k, n, fmt, span):
    """main_grads as views of one buffer (as Megatron's gradient buffer holds them: the TMA-stored epilogue;
    ones not a whole number of rows apart are refused; one expert alone always lies in a span), and new bf16
    outputs. Accumulation runs 8 times (before the stage release was fenced its wrong tiles came in about one
    call in five)."""
    x, dy, ws, _, p = _case(counts, k, n, fmt, seed=7)
    layout, xq, dyq, _ = _quantized(x, dy, ws, counts, p, device_counts=True)
    args = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    g = torch.Generator("cuda").manual_seed(5)
    if span:  # reversed, with a gap of one row between experts: addresses a whole number of rows apart
        buf = torch.randn((n + 1) * len(counts), k, device="cuda", generator=g)
        views = lambda b: [b[(n + 1) * i : (n + 1) * i + n] for i in reversed(range(len(counts)))]  # noqa: E731
        start = views(buf)
    else:  # every other one 16 bytes off: never a whole number of rows apart
        buf = torch.randn(len(counts), n * k + 4, device="cuda", generator=g)
        views = lambda b: [b[i, 4 * (i % 2) : 4 * (i % 2) + n * k].view(n, k) for i in range(len(counts))]  # noqa: E731
        start = views(buf)
    keep = [s.clone() for s in start]
    mg_portable = [s.clone() for s in start]
    grouped_wgrad(*args, out_dtype=torch.float32, accumulate_into=mg_portable)
    if not span and len(counts) > 1:
        with pytest.raises(GluonUnsupported, match="one span of memory"):
            gluon_wgrad(*args, out_dtype=torch.float32, accumulate_into=start)
        mg = mg_portable
    else:
        for rep in range(8):
            again = views(buf.clone())
            gluon_wgrad(*args, out_dtype=torch.float32, accumulate_into=again)
            bad = [e for e in range(len(counts)) if not same(again[e], mg_portable[e])]
            assert not bad, f"run {rep}: main_grad of experts {bad} differs from the portable kernel"
        mg = gluon_wgrad(*args, out_dtype=torch.float32, accumulate_into=start)
        assert all(a is b for a, b in zip(mg, start)), "accumulate_into is updated in place and returned"
    dw = gluon_wgrad(*args, out_dtype=torch.bfloat16)
    dw_portable = grouped_wgrad(*args, out_dtype=torch.bfloat16)
    for e, c, _, poff, pc in _segments(counts):
        assert same(mg[e], mg_portable[e]), f"main_grad, expert {e} (count {c}) vs the portable grouped kernel"
        assert same(dw[e], dw_portable[e]), f"bf16 dW, expert {e} (count {c}) vs the portable grouped kernel"
        if c == 0:
            assert same(mg[e], keep[e]) and not dw[e].any(), f"empty expert {e}"
            continue
        # the dense kernel on the expert's padded segment (zero columns past its count: the masked loads)
        seg = (dyq.columnwise_data[:, poff : poff + pc].contiguous(),
               dyq.columnwise_scale_inv[poff // BLOCK : (poff + pc) // BLOCK].contiguous(),
               xq.columnwise_data[:, poff : poff + pc].contiguous(),
               xq.columnwise_scale_inv[poff // BLOCK : (poff + pc) // BLOCK].contiguous())  # fmt: skip
        dense_mg = dense_gluon(*seg, b_block_dim=1, out_dtype=torch.float32, accumulate_into=keep[e].clone())
        dense_dw = dense_gluon(*seg, b_block_dim=1, out_dtype=torch.bfloat16)
        assert same(mg[e], dense_mg), f"main_grad, expert {e} (count {c}) vs the dense loop"
        assert same(dw[e], dense_dw), f"bf16 dW, expert {e} (count {c}) vs the dense loop"
    if span:  # the gap rows between the experts' main_grads are untouched
        gaps = torch.stack([buf[(n + 1) * i + n] for i in range(len(counts))])
        assert same(gaps, torch.randn((n + 1) * len(counts), k, device="cuda",
                                      generator=torch.Generator("cuda").manual_seed(5))[n :: n + 1])  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_wgrad_into_outputs_in_no_span_stores_from_registers(fmt):
    """New bf16 outputs of M rows with M % 64 != 0 lie in no one span (a 64-row piece would cross into the next
    expert's output): the epilogue stores from registers (``store_rows``), bit for bit the portable kernel's."""
    from primus_fp8_plugin.kernels.sm90.gemm_grouped import output_span

    counts, k, n = ragged(9, 4), 512, 400  # wgrad dW [n, k]: M = 400 rows, 400 % 64 == 16
    x, dy, ws, _, p = _case(counts, k, n, fmt, seed=11)
    layout, xq, dyq, _ = _quantized(x, dy, ws, counts, p, device_counts=True)
    args = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    dw = gluon_wgrad(*args, out_dtype=torch.bfloat16)
    assert output_span(dw, n, k) is None, "the outputs must lie in no one span: the register-store epilogue"
    want = grouped_wgrad(*args, out_dtype=torch.bfloat16)
    for e, c in enumerate(counts):
        assert same(dw[e], want[e]), f"bf16 dW, expert {e} (count {c}) vs the portable grouped kernel"
        assert c > 0 or not dw[e].any(), f"empty expert {e} gets zeros"


@requires_hopper
def test_unsupported_inputs_raise_gluon_unsupported():
    counts, k, n = [3, 5], 520, 256  # K % 16 != 0
    x, dy, ws, _, p = _case(counts, k, n, "E4M3")
    layout, xq, _, wq = _quantized(x, dy, ws, counts, p, device_counts=False)
    with pytest.raises(GluonUnsupported):
        gluon_fwd(xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, layout,
                           out_dtype=torch.bfloat16)  # fmt: skip
    counts, k, n = [3, 5], 512, 256
    x, dy, ws, _, p = _case(counts, k, n, "E4M3")
    layout, xq, dyq, wq = _quantized(x, dy, ws, counts, p, device_counts=False)
    with pytest.raises(GluonUnsupported):  # fp32 fwd output: the 128x256 tile spills
        gluon_fwd(xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, layout,
                           out_dtype=torch.float32)  # fmt: skip
    with pytest.raises(GluonUnsupported):  # plain fp32 wgrad output
        gluon_wgrad(dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data,
                            xq.columnwise_scale_inv, layout, out_dtype=torch.float32)  # fmt: skip


@requires_hopper
def test_backend_runs_the_gluon_grouped_kernels():
    """The triton and hopper backends' grouped GEMMs on Hopper are the Gluon kernels' results."""
    from primus_fp8_plugin.grouped import gemm_fwd_grouped, gemm_wgrad_grouped

    counts, k, n = [0, 129, 256, 40], 512, 768
    x, dy, ws, bias, p = _case(counts, k, n, "E4M3")
    layout, xq, dyq, wq = _quantized(x, dy, ws, counts, p, device_counts=True)
    want = gluon_fwd(xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, layout,
                              out_dtype=torch.bfloat16, bias=bias)  # fmt: skip
    want_dw = gluon_wgrad(dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data,
                                  xq.columnwise_scale_inv, layout, out_dtype=torch.bfloat16)  # fmt: skip
    from primus_fp8_plugin import backend_availability

    for backend in (b for b in ("triton", "hopper") if backend_availability(b, "cuda")):
        assert same(gemm_fwd_grouped(xq, wq, bias, backend=backend), want), backend
        got_dw = gemm_wgrad_grouped(dyq, xq, backend=backend, out_dtype=torch.bfloat16)
        assert all(same(a, b) for a, b in zip(got_dw, want_dw)), backend


WEIGHT_CASES = [(1, 144, 272, torch.bfloat16), (8, 400, 528, torch.bfloat16), (5, 256, 2048, torch.float32),
                (32, 1536, 2048, torch.bfloat16)]  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("num_experts, n, k, dtype", WEIGHT_CASES)
def test_weight_per_expert_gluon_equals_the_batched_kernel(num_experts, n, k, dtype):
    """One dense Gluon launch per expert into the stacked buffers (what the triton backend runs for a few
    experts on Hopper) against the portable batched kernel, bit for bit: ragged blocks, a NaN, W stacked or as a
    list, ``out`` reused; a misfit ``out`` is refused."""
    from primus_fp8_plugin.kernels.sm90.quantize_grouped import quantize_128x128_per_expert_gluon
    from primus_fp8_plugin.kernels.sm90.quantize_weight import quantize_128x128_gluon
    from primus_fp8_plugin.kernels.triton.quantize_grouped import quantize_128x128_batched

    p = BlockwiseRecipe().params(TensorRole.WEIGHT)
    ws = [make_input((n, k), dtype=dtype, seed=30 + e, device="cuda") for e in range(num_experts)]
    ws[-1][n // 2, k - 1] = float("nan")
    want = quantize_128x128_batched(ws, p)
    got = quantize_128x128_per_expert_gluon(ws, p)
    assert all(same(getattr(got, c), getattr(want, c)) for c in COPIES)
    again = quantize_128x128_per_expert_gluon(torch.stack(ws), p, out=got)
    assert again is got and all(same(getattr(got, c), getattr(want, c)) for c in COPIES)
    with pytest.raises(ValueError, match="needs contiguous"):
        quantize_128x128_gluon(ws[0], p, out=quantize_128x128_gluon(ws[0][:, :-16].contiguous(), p))
