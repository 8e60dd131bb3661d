"""GPU backends (triton, cublas, hopper; flydsl on AMD) on a CUDA device: bit-exact quantization, GEMMs within 2e-3 of an
fp64 emulation, TE goldens through the validate command. Skipped without a GPU (CI)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import (
    BlockwiseRecipe,
    QuantParams,
    TensorRole,
    gemm_dgrad,
    gemm_fwd,
    gemm_wgrad,
    quantize_activation,
    quantize_weight,
)
from primus_fp8_plugin.validate import main as validate_main
from primus_fp8_plugin.validate import rel_frobenius

from ..conftest import GOLDEN_DIR, make_input

pytestmark = pytest.mark.gpu


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


# the Hopper weight quantizer (Gluon) takes N and K multiples of 16 ((208, 400), (2064, 1040): partial
# 128-blocks in both dims); the other shapes go to the Triton kernel
QUANT_SHAPES = [(1, 128), (7, 272), (200, 320), (130, 29568), (3000, 1040), (257, 16), (208, 400), (2064, 1040)]


@pytest.mark.parametrize("m, k", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantization_bit_exact_with_reference(gpu_backend, m, k, dtype):
    x = make_input((m, k), dtype=torch.float32, seed=m * k).cuda()
    x = (x / x.abs().max() * (1000 if dtype is torch.float16 else 1e6)).to(dtype)
    if m > 5:
        x[m // 2, : min(k, 128)] = 0
        x[1, 3] = float("nan")
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for pow2 in (True, False):
            for block_dim in (1, 2):
                p = QuantParams(fp8, block_dim, pow2_scales=pow2)
                quant = quantize_activation if block_dim == 1 else quantize_weight
                ours, ref = quant(x, p, backend=gpu_backend), quant(x, p, backend="reference")
                for name, t in ours.to_te().items():
                    assert torch.equal(bits(t), bits(ref.to_te()[name])), (name, fp8, pow2, block_dim)


# (17920, 136 / 56, 256): more 128-row tiles (140) than the H200 has SMs, after N-edge tiles of 3 / 1
# output pieces (the quarter-chain epilogue)
GEMM_SHAPES = [(1, 256, 512), (200, 384, 272), (256, 640, 29568), (2048, 2048, 2048), (130, 144, 400), (4096, 1024, 1040),
               (17920, 136, 256), (17920, 56, 256)]  # fmt: skip


@pytest.mark.parametrize("m, n, k", GEMM_SHAPES)
def test_gemms_match_fp64_emulation(gpu_backend, m, n, k):
    r = BlockwiseRecipe()
    x = make_input((m, k), seed=1).cuda()
    w = (make_input((n, k), seed=2, spread=False) / k**0.5).to(torch.bfloat16).cuda()
    dy = make_input((m, n), seed=3).cuda()
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    xq = quantize_activation(x, r.params(TensorRole.INPUT), backend=gpu_backend)
    wq = quantize_weight(w, r.params(TensorRole.WEIGHT), backend=gpu_backend)
    dyq = quantize_activation(dy, r.params(TensorRole.GRAD_OUTPUT), backend=gpu_backend)
    xd, wd, dyd = (t.dequantize(torch.float32).double() for t in (xq, wq, dyq))
    # bf16 outputs are compared with the fp64 result rounded to bf16: a bf16 output's own rounding is
    # up to 2^-9 = 1.95e-3 per element, which would leave no room under the 2e-3 bound
    y = gemm_fwd(xq, wq, bias, backend=gpu_backend)
    assert y.dtype == torch.bfloat16
    assert rel_frobenius(y, (xd @ wd.t() + bias.double()).to(y.dtype)) <= 2e-3
    dx = gemm_dgrad(dyq, wq, backend=gpu_backend)
    assert rel_frobenius(dx, (dyd @ wd).to(dx.dtype)) <= 2e-3
    dy_col = dyq.dequantize(torch.float32, copy="columnwise").double()
    x_col = xq.dequantize(torch.float32, copy="columnwise").double()
    dw = gemm_wgrad(dyq, xq, out_dtype=torch.float32, backend=gpu_backend)
    assert rel_frobenius(dw, dy_col.t() @ x_col) <= 2e-3
    main_grad = torch.randn(n, k, device="cuda")
    start = main_grad.clone()
    gemm_wgrad(dyq, xq, accumulate_into=main_grad, backend=gpu_backend)
    assert rel_frobenius(main_grad, start.double() + dy_col.t() @ x_col) <= 2e-3


def test_validate_command_passes_on_te_goldens(gpu_backend, capsys):
    assert validate_main(["--golden", str(GOLDEN_DIR), "--backend", gpu_backend, "--device", "cuda"]) == 0
    print(capsys.readouterr().out.splitlines()[-1])
