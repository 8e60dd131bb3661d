"""The LDS-staged FlyDSL GEMMs' index arithmetic, executed on the CPU: ``flydsl_emulation.emulate`` walks the
kernel's L2-grouped tile schedule and its waves' 16x16 strips, gathers B at the kernel's preshuffled
addresses, picks each strip's 128x128 scale block as the kernel does and applies the buffer bounds
(ragged M); its result must match the reference backend's blockwise GEMM. The FlyDSL kernels
themselves cannot run here (no AMD GPU): tests/tools/test_flydsl_aot.py compiles them for gfx950."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.kernels.gfx950 import gemm_lds as G
from primus_fp8_plugin.kernels.gfx950 import heuristics as H
from primus_fp8_plugin.preshuffle import preshuffle

from ..conftest import make_input
from .flydsl_emulation import emulate

REF = ReferenceBackend()
E4M3 = torch.float8_e4m3fn


def _close(ours, ref):
    assert not torch.isnan(ours).any(), "a tile was never written"
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-6 * ref.abs().max().item())


SHAPES = [("FWD_128x128", 200, 256, 384), ("FWD_128x256", 77, 256, 256), ("FWD_128x128", 900, 128, 128)]


@pytest.mark.parametrize("cfg_name,m,n,k", SHAPES)
def test_fprop_schedule_preshuffle_addressing_and_ragged_m(cfg_name, m, n, k):
    cfg = getattr(H, cfg_name)
    if m > 800:  # 8 M tiles: L2 groups of 3, 3, 2
        cfg = G.TileConfig(cfg.bm, cfg.bn, cfg.waves, cfg.b_layout, waves_m=cfg.waves_m, group_m=3)
    x = REF.quantize_act(make_input((m, k), seed=m), QuantParams(E4M3, 1), rowwise=True, columnwise=False)
    w = REF.quantize_weight(make_input((n, k), seed=n + 1), QuantParams(E4M3, 2))
    ours = emulate(cfg, x.rowwise_data, x.rowwise_scale_inv, preshuffle(w.rowwise_data), w.rowwise_scale_inv, n_out=n)
    _close(ours, REF.gemm_fwd(x, w, None, torch.float32))


def test_dgrad_reads_the_preshuffled_transpose():
    m, n, k = 130, 384, 256  # W [n, k]; dgrad's B is W^T [k, n], its output has k columns
    dy = REF.quantize_act(make_input((m, n), seed=5), QuantParams(E4M3, 1), rowwise=True, columnwise=False)
    w = REF.quantize_weight(make_input((n, k), seed=6), QuantParams(E4M3, 2))
    ours = emulate(H.FWD_128x256, dy.rowwise_data, dy.rowwise_scale_inv, preshuffle(w.columnwise_data),
                     w.columnwise_scale_inv, n_out=k)  # fmt: skip
    _close(ours, REF.gemm_dgrad(dy, w, torch.float32))


def test_wgrad_k_major_column_scales():
    t, n, k = 512, 256, 128  # tokens, W [n, k]
    p = QuantParams(E4M3, 1)
    dy = REF.quantize_act(make_input((t, n), seed=7), p, rowwise=False, columnwise=True)
    x = REF.quantize_act(make_input((t, k), seed=8), p, rowwise=False, columnwise=True)
    ours = emulate(H.WGRAD_256x128, dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data,
                     x.columnwise_scale_inv, n_out=k)  # fmt: skip
    _close(ours, REF.gemm_wgrad(dy, x, torch.float32, None))


@pytest.mark.parametrize("tokens,n,k", [(384, 256, 256), (300, 384, 128), (77, 160, 128)])
def test_wgrad_ragged_m_odd_and_padded_token_counts(tokens, n, k):
    """wgrad with a masked last M tile (N = 384, 160 against 256-row tiles), an odd number of 128-token
    steps (384: the kernel's tail step) and token counts that are not multiples of 128 (zero-padded by
    ``pad_contraction``, the scales as quantized); the scale loads keep their K step in ``voffset``."""
    p = QuantParams(E4M3, 1)
    dy = REF.quantize_act(make_input((tokens, n), seed=tokens), p, rowwise=False, columnwise=True)
    x = REF.quantize_act(make_input((tokens, k), seed=tokens + 1), p, rowwise=False, columnwise=True)
    a, b = G.pad_contraction(dy.columnwise_data), G.pad_contraction(x.columnwise_data)
    assert a.shape == (n, -(-tokens // 128) * 128) and b.shape[1] == a.shape[1]
    assert G.scale_a_split(H.WGRAD_256x128, n) == (n % 256 == 0)
    ours = emulate(H.WGRAD_256x128, a, dy.columnwise_scale_inv, b, x.columnwise_scale_inv, n_out=k)
    _close(ours, REF.gemm_wgrad(dy, x, torch.float32, None))
    assert G.wgrad_fits(H.WGRAD_256x128, n, k, tokens) and not G.wgrad_fits(H.WGRAD_256x128, n, 192, tokens)


def test_pad_contraction_is_a_zero_padded_copy():
    t = torch.randn(5, 130).to(E4M3)
    p = G.pad_contraction(t)
    assert p.shape == (5, 256) and p.dtype == E4M3
    assert torch.equal(p[:, :130].view(torch.uint8), t.view(torch.uint8)) and not p[:, 130:].view(torch.uint8).any()
    same = torch.randn(3, 256).to(E4M3)
    assert G.pad_contraction(same) is same


def test_emulation_catches_a_wrong_soffset(monkeypatch):
    """The B strips' soffset formula is what the kernel issues; a wrong K-step stride fails the check."""
    m, n, k = 64, 256, 256
    x = REF.quantize_act(make_input((m, k), seed=11), QuantParams(E4M3, 1), rowwise=True, columnwise=False)
    w = REF.quantize_weight(make_input((n, k), seed=12), QuantParams(E4M3, 2))
    ref = REF.gemm_fwd(x, w, None, torch.float32)
    right = G.b_soffset
    monkeypatch.setattr(G, "b_soffset", lambda cfg, kk, kt, rn: right(cfg, kk, kt, rn) - kt * 1024)
    wrong = emulate(H.FWD_128x128, x.rowwise_data, x.rowwise_scale_inv, preshuffle(w.rowwise_data),
                      w.rowwise_scale_inv, n_out=n)  # fmt: skip
    assert not torch.allclose(wrong, ref, rtol=1e-3)


def test_bounds_model_rejects_an_unchecked_scale_offset(monkeypatch):
    """A ragged last M tile with the scales' K step in soffset would read past the scale tensor."""
    tokens, n, k = 256, 384, 128
    p = QuantParams(E4M3, 1)
    dy = REF.quantize_act(make_input((tokens, n), seed=13), p, rowwise=False, columnwise=True)
    x = REF.quantize_act(make_input((tokens, k), seed=14), p, rowwise=False, columnwise=True)
    monkeypatch.setattr(G, "scale_a_split", lambda cfg, m: True)
    with pytest.raises(AssertionError, match="unmasked load"):
        emulate(H.WGRAD_256x128, dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data,
                  x.columnwise_scale_inv, n_out=k)  # fmt: skip


def _padded_weight(n, k, seed, garbage=False):
    """A preshuffled weight whose W^T storage is padded as the quantizer pads it (K % 256 == 128); with
    ``garbage`` the padding holds other bytes (NaN encodings included) and other scales, as a view into
    a larger storage (e.g. one expert of a stacked weight) would."""
    from primus_fp8_plugin import BlockwiseFp8Tensor
    from primus_fp8_plugin.preshuffle import dgrad_padded_rows

    w = REF.quantize_weight(make_input((n, k), seed=seed), QuantParams(E4M3, 2))
    kp = dgrad_padded_rows(k)
    data = torch.zeros(kp, n, dtype=torch.uint8)
    data[:k] = w.columnwise_data.view(torch.uint8)
    scales = torch.ones(kp // 128, w.columnwise_scale_inv.shape[1])
    scales[: k // 128] = w.columnwise_scale_inv
    if garbage:
        data[k:] = torch.randint(0, 256, (kp - k, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        data[k, :4] = 0x7F  # E4M3 NaN
        scales[k // 128 :] = float("inf")
    wt = preshuffle(data.view(E4M3)).flatten()[: k * n].view(k, n)
    wq = BlockwiseFp8Tensor((n, k), 2, E4M3, torch.float32, rowwise_data=preshuffle(w.rowwise_data),
                            rowwise_scale_inv=w.rowwise_scale_inv, columnwise_data=wt,
                            columnwise_scale_inv=scales[: k // 128], layout="preshuffle16")  # fmt: skip
    return w, wq


@pytest.mark.parametrize("m,n,k,garbage", [(130, 256, 384, False), (64, 128, 640, False), (70, 256, 384, True)])
def test_dgrad_on_k_padded_wt_uses_256_wide_tiles(m, n, k, garbage):
    """K % 256 == 128 with W^T's storage padded: dgrad runs 128x256 tiles over K + 128 output columns and
    does not store the padded ones (the last tile's pad strips), so whatever the padding holds only
    reaches columns that are never written."""
    w, wq = _padded_weight(n, k, seed=k, garbage=garbage)
    dy = REF.quantize_act(make_input((m, n), seed=m), QuantParams(E4M3, 1), rowwise=True, columnwise=False)
    b, sb, n_valid, padded = G.dgrad_operands(wq)
    cfg = H.lds_dgrad(dy, k, padded)
    assert cfg is H.FWD_128x256 and b.shape == (k + 128, n) and sb.shape[0] == (k + 128) // 128 and n_valid == k
    assert G.pad_strip_set(cfg, 128) == {4, 5, 6, 7}
    ours = emulate(cfg, dy.rowwise_data, dy.rowwise_scale_inv, b, sb, n_out=k + 128, n_valid=k)
    assert ours.shape == (m, k)
    _close(ours, REF.gemm_dgrad(dy, w, torch.float32))
    # without the padded storage (a copy of the tensor): the 128-wide tile on the tensors as they are
    wq.columnwise_data = wq.columnwise_data.clone()
    b2, _, nv2, padded2 = G.dgrad_operands(wq)
    assert H.lds_dgrad(dy, k, padded2) is H.FWD_128x128 and b2.shape == (k, n) and nv2 == k


def test_pad_strips_must_be_whole_strips():
    with pytest.raises(ValueError, match="whole strips"):
        G.pad_strip_set(H.FWD_128x256, 112)
    with pytest.raises(ValueError, match="whole strips"):
        G.pad_strip_set(H.WGRAD_256x128, 64)
    assert G.pad_strip_set(H.FWD_128x256, 0) == frozenset()


def test_emulation_catches_a_wrong_address():
    """The check can fail: K-major bytes read as if preshuffled give a different product."""
    m, n, k = 64, 128, 128
    x = REF.quantize_act(make_input((m, k), seed=9), QuantParams(E4M3, 1), rowwise=True, columnwise=False)
    w = REF.quantize_weight(make_input((n, k), seed=10), QuantParams(E4M3, 2))
    wrong = emulate(H.FWD_128x128, x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv, n_out=n)
    assert not torch.allclose(wrong, REF.gemm_fwd(x, w, None, torch.float32), rtol=1e-3)


def test_tile_order_covers_every_tile_once_in_groups():
    for num_m, num_n, g in [(7, 3, 4), (1, 5, 8), (16, 2, 8), (9, 1, 2)]:
        tiles = [G.tile_of(p, num_m, num_n, g) for p in range(num_m * num_n)]
        assert sorted(tiles) == [(i, j) for i in range(num_m) for j in range(num_n)]
        assert all(tiles[p][0] // g == p // (g * num_n) for p in range(num_m * num_n))  # a group's M tiles come first


def test_configs_reject_tiles_that_do_not_split():
    with pytest.raises(ValueError, match="does not split"):
        G.TileConfig(128, 80, 4, "preshuffle16").check()
    with pytest.raises(ValueError, match="b_layout"):
        G.TileConfig(128, 128, 4, "nk").check()
