"""The FlyDSL LDS kernels' arithmetic in torch, walking their schedule (``kernels/gfx950/gemm_lds.py``):
what the CPU tests check the kernels' index math with (the kernels are compile-only here). It calls the
kernel module's index functions (``G.b_soffset``, ...) through the module, so that a test can replace one
and see the emulation fail."""

from __future__ import annotations

import torch

from primus_fp8_plugin.kernels.gfx950 import gemm_lds as G
from primus_fp8_plugin.kernels.gfx950.gemm_lds import BK, SCALE_BLOCK, TileConfig
from primus_fp8_plugin.preshuffle import preshuffle_offset


def emulate(cfg: TileConfig, a, sa, b, sb, *, n_out: int, n_valid: int | None = None):
    """The kernel's arithmetic in torch, walking its schedule: ``C [M, n_out]`` fp32 from FP8 ``a`` [M, K],
    ``b`` (``cfg.b_layout``: preshuffled bytes [n_out, K] or K-major) and TE-layout scales.

    Mirrors the index math, not the lanes: the L2-grouped tile walk (``tile_of``), each wave's 16x16
    strips (wave ``(i, j)`` of ``waves_m x waves_n`` owns rows ``16 (i + waves_m r)`` and columns
    ``16 (j + waves_n c)`` of its tile), the scale block each strip uses (``strip_scale_block``), and
    every buffer load's address split as the kernel issues it: a lane address in ``voffset`` plus an SGPR
    ``soffset`` (B: ``b_soffset`` from the strip-0 / step-0 address; A and a K-major B: the K step
    ``128 kt``; scales: the K step in ``voffset``, or in ``soffset`` where ``scale_a_split``). The
    bounds model: a load is masked (reads 0) when its ``voffset`` is past the operand's end (``soffset``
    is not range-checked), and an unmasked load past the end fails the emulation; rows past M are not
    stored, nor (``n_valid < n_out``: B's rows past ``n_valid`` are zero padding) the last N tile's
    ``pad_strip_set`` strips, which must be exactly those past ``n_valid``; the result has ``n_valid``
    columns. Per 128-K step: fp32 partial, then ``acc = fma(partial, sa * sb, acc)`` (the fma in
    float64, rounded once)."""
    m, k = a.shape
    a_flat, b_flat = a.float().flatten(), b.float().flatten()
    sa_flat, sb_flat = sa.flatten(), sb.flatten()
    pre = cfg.b_layout == "preshuffle16"
    sa_split = G.scale_a_split(cfg, m)

    def gather(flat, voff, soff=0):  # a bounds-checked buffer load: voffset checked, soffset added after
        ok = voff < flat.numel()
        idx = voff + soff
        assert not torch.any(ok & (idx >= flat.numel())), "an unmasked load past the operand's end"
        return torch.where(ok, flat[idx.clamp(max=flat.numel() - 1)], torch.zeros((), dtype=flat.dtype))

    n_valid = n_out if n_valid is None else n_valid
    pad_strips = G.pad_strip_set(cfg, n_out - n_valid)
    out = torch.full((m, n_valid), float("nan"))
    num_pid_m, num_pid_n = -(-m // cfg.bm), n_out // cfg.bn
    seen = set()
    kk = torch.arange(BK)
    for pid in range(num_pid_m * num_pid_n):
        pm, pn = G.tile_of(pid, num_pid_m, num_pid_n, cfg.group_m)
        assert (pm, pn) not in seen and 0 <= pm < num_pid_m and 0 <= pn < num_pid_n, (pid, pm, pn)
        seen.add((pm, pn))
        for wi in range(cfg.waves_m):
            for wj in range(cfg.waves_n):
                cols0 = pn * cfg.bn + 16 * wj + torch.arange(16)  # the wave's strip 0
                for r in range(cfg.rm):
                    rows = pm * cfg.bm + 16 * (wi + cfg.waves_m * r) + torch.arange(16)
                    for c in range(cfg.rn):
                        cols = cols0 + 16 * cfg.waves_n * c
                        acc = torch.zeros(16, 16, dtype=torch.float32)
                        for kt in range(k // BK):
                            av = gather(a_flat, rows[:, None] * k + kk[None, :], kt * BK)
                            if pre:
                                bv = gather(b_flat, preshuffle_offset(cols0[:, None], kk[None, :], k), G.b_soffset(cfg, k, kt, c))
                                blk = (pn * cfg.bn) // SCALE_BLOCK + G.strip_scale_block(cfg, c)
                                assert torch.all(cols // SCALE_BLOCK == blk), "strip straddles a scale block"
                                s_b = gather(sb_flat, torch.tensor([blk * sb.stride(0) + kt])).expand(16)
                            else:
                                bv = gather(b_flat, cols[:, None] * k + kk[None, :], kt * BK)
                                s_b = gather(sb_flat, cols, kt * sb.stride(0))
                            if sa_split:
                                s_a = gather(sa_flat, rows, kt * sa.stride(0))
                            else:
                                s_a = gather(sa_flat, kt * sa.stride(0) + rows)
                            part = (av.double() @ bv.double().t()).float()  # exact for E4M3, as the reference
                            scale = s_a[:, None] * s_b[None, :]
                            acc = (part.double() * scale.double() + acc.double()).float()
                        if pn == num_pid_n - 1 and c in pad_strips:
                            assert torch.all(cols >= n_valid), "a skipped strip holds real columns"
                            continue
                        assert torch.all(cols < n_valid), "a stored strip holds padded columns"
                        keep = rows < m
                        out[rows[keep][:, None], cols[None, :]] = acc[keep]
    assert len(seen) == num_pid_m * num_pid_n
    return out
