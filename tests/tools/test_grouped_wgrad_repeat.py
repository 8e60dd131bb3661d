"""tools/grouped_wgrad_repeat.py without an sm_90 GPU: it says what it needs instead of failing inside torch."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_hopper_gpu():
    from tools import grouped_wgrad_repeat

    with pytest.raises(SystemExit, match="needs an NVIDIA sm_90 GPU"):
        grouped_wgrad_repeat.main(["--reps", "1"])


class _Dequantized:
    """Stands in for a quantized expert operand: ``dequantize`` returns a fixed high-precision tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def dequantize(self, dtype, copy):
        assert copy == "columnwise"
        return self.t.to(dtype)


def test_diagnose_names_each_kind_of_wrong_tile():
    """Three experts, each with one tile spoiled a known way; the diagnosis names each way, and nothing else."""
    from tools.grouped_wgrad_repeat import block_contributions, diagnose

    g = torch.Generator().manual_seed(0)
    tokens, n, k = [300, 200, 129], 512, 256
    xs = [_Dequantized(torch.randn(t, k, generator=g)) for t in tokens]
    dys = [_Dequantized(torch.randn(t, n, generator=g)) for t in tokens]
    start = [torch.randn(n, k, generator=g) for _ in tokens]
    ref = [s + dy.t.T @ x.t for s, dy, x in zip(start, dys, xs)]
    out = [r.clone() for r in ref]
    # expert 0: tile (0, 128) holds tile (256, 0)'s dW; expert 1: token block 1 missing in tile (256, 128);
    # expert 2: tile (0, 0) never written
    out[0][0:256, 128:256] = start[0][0:256, 128:256] + (ref[0] - start[0])[256:512, 0:128]
    out[1][256:512, 128:256] -= block_contributions(dys[1].t, xs[1].t)[1][256:512, 128:256]
    out[2][0:256, 0:128] = start[2][0:256, 0:128]
    lines = diagnose(out, ref, start, xs, dys, [0, 1, 2], most=8)
    assert len(lines) == 3
    assert lines[0].startswith("expert 0 tile (0,128)") and "best match tile (256,0)'s dW instead" in lines[0]
    assert lines[1].startswith("expert 1 tile (256,128)") and "best match token block 1 missing" in lines[1]
    assert lines[2].startswith("expert 2 tile (0,0)") and "best match store skipped (-dW)" in lines[2]
    assert diagnose(ref, ref, start, xs, dys, [0, 1, 2], most=8) == []  # right tiles: nothing to explain


def test_scale_fit_finds_a_wrong_row_scale_of_one_token_block():
    """Rows 200-231 of a tile where token block 2's row scale was 1000x too large: the per-row fit on block 2
    explains the residual exactly, with factor 999 on those rows; the per-column fit does not."""
    from tools.grouped_wgrad_repeat import scale_fit

    g = torch.Generator().manual_seed(1)
    blocks = [torch.randn(256, 128, generator=g, dtype=torch.float64) for _ in range(3)]
    r = torch.zeros(256, 128, dtype=torch.float64)
    r[200:232] = 999.0 * blocks[2][200:232]
    row = scale_fit(r, blocks, per_row=True)
    assert row.startswith("row factors on token block 2: relative distance ") and row.endswith("(200-231, factors 999..999)")
    assert float(row.split("distance ")[1].split(" ")[0]) < 1e-12
    col = scale_fit(r, blocks, per_row=False)
    assert col.startswith("column factors on token block 2") and float(col.split("distance ")[1].split(" ")[0]) > 0.1
