"""The LDS-staged FlyDSL GEMMs on an MI355X (gfx950): fprop/dgrad reading the preshuffled weight and
wgrad, against the reference backend's blockwise GEMM, over ragged M (one binary per N, K), both
fprop tiles and ragged wgrad (M, odd and padded token counts); and the backend's preshuffled weight
copies bit for bit against the reference's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from primus_fp8_plugin import QuantParams, backend_availability
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.kernels.gfx950 import gemm_lds as G
from primus_fp8_plugin.kernels.gfx950 import heuristics as H
from primus_fp8_plugin.preshuffle import preshuffle

from ..conftest import make_input

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn
REF = ReferenceBackend()


@pytest.fixture(scope="module", autouse=True)
def flydsl_device():
    avail = backend_availability("flydsl", "cuda")
    if not avail:
        pytest.skip(f"flydsl: {avail.reason}")


def _close(ours, ref):
    torch.testing.assert_close(ours.float().cpu(), ref.float().cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("cfg_name", ["FWD_128x128", "FWD_128x256"])
@pytest.mark.parametrize("m", [1, 77, 300, 1000, 4096])
def test_fprop_and_dgrad_any_m(cfg_name, m):
    cfg = getattr(H, cfg_name)
    n, k = 512, 768
    p1, p2 = QuantParams(E4M3, 1), QuantParams(E4M3, 2)
    x = REF.quantize_act(make_input((m, k), seed=m), p1, rowwise=True, columnwise=False)
    dy = REF.quantize_act(make_input((m, n), seed=m + 1), p1, rowwise=True, columnwise=False)
    w = REF.quantize_weight(make_input((n, k), seed=2), p2)
    xc, dyc = (t.rowwise_data.cuda() for t in (x, dy))
    y = G.blockwise_gemm_lds(xc, x.rowwise_scale_inv.cuda(), preshuffle(w.rowwise_data).cuda(), w.rowwise_scale_inv.cuda(),
                             cfg=cfg, out_dtype=torch.float32)  # fmt: skip
    _close(y, REF.gemm_fwd(x, w, None, torch.float32))
    dx = G.blockwise_gemm_lds(dyc, dy.rowwise_scale_inv.cuda(), preshuffle(w.columnwise_data).cuda(),
                              w.columnwise_scale_inv.cuda(), cfg=cfg, out_dtype=torch.float32)  # fmt: skip
    _close(dx, REF.gemm_dgrad(dy, w, torch.float32))


@pytest.mark.parametrize("tokens,n", [(256, 512), (2048, 512), (384, 384), (300, 160), (1, 256)])
def test_wgrad(tokens, n):
    """Whole and ragged: a masked last M tile (N = 384, 160), an odd number of 128-token steps (384)
    and token counts padded to a multiple of 128 (300, 1)."""
    k = 384
    p = QuantParams(E4M3, 1)
    dy = REF.quantize_act(make_input((tokens, n), seed=3), p, rowwise=False, columnwise=True)
    x = REF.quantize_act(make_input((tokens, k), seed=4), p, rowwise=False, columnwise=True)
    dw = G.blockwise_gemm_lds(dy.columnwise_data.cuda(), dy.columnwise_scale_inv.cuda(), x.columnwise_data.cuda(),
                              x.columnwise_scale_inv.cuda(), cfg=H.WGRAD_256x128, out_dtype=torch.float32)  # fmt: skip
    _close(dw, REF.gemm_wgrad(dy, x, torch.float32, None))


def test_backend_weight_copies_are_preshuffled_reference():
    from primus_fp8_plugin.backends.flydsl import FlydslBackend

    w = make_input((512, 768), seed=5).cuda()
    p = QuantParams(E4M3, 2)
    ours, ref = FlydslBackend().quantize_weight(w, p), REF.quantize_weight(w.cpu(), p)
    assert ours.layout == "preshuffle16"
    assert torch.equal(ours.rowwise_data.cpu().view(torch.uint8), preshuffle(ref.rowwise_data).view(torch.uint8))
    assert torch.equal(ours.columnwise_data.cpu().view(torch.uint8), preshuffle(ref.columnwise_data).view(torch.uint8))


@pytest.mark.parametrize("m", [1, 130, 1000])
def test_backend_dgrad_on_k_padded_wt(m):
    """K % 256 == 128: the backend's quantizer pads W^T's storage and dgrad runs 128x256 tiles over it,
    storing only the K real columns (the last tile's padded strips skipped)."""
    from primus_fp8_plugin.backends.flydsl import FlydslBackend

    n, k = 256, 384
    be, p1, p2 = FlydslBackend(), QuantParams(E4M3, 1), QuantParams(E4M3, 2)
    w = make_input((n, k), seed=7)
    wq = be.quantize_weight(w.cuda(), p2)
    assert G.dgrad_operands(wq)[3], "W^T's storage padded: the 128x256 tile runs over it"
    dy = REF.quantize_act(make_input((m, n), seed=m), p1, rowwise=True, columnwise=False)
    dyc = dataclasses.replace(dy, rowwise_data=dy.rowwise_data.cuda(), rowwise_scale_inv=dy.rowwise_scale_inv.cuda())
    dx = be.gemm_dgrad(dyc, wq, torch.float32)
    assert dx.shape == (m, k) and dx.is_contiguous()
    _close(dx, REF.gemm_dgrad(dy, REF.quantize_weight(w, p2), torch.float32))
