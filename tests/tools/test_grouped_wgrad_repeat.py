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


def _case(tokens, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [_Dequantized(torch.randn(t, k, generator=g)) for t in tokens]
    dys = [_Dequantized(torch.randn(t, n, generator=g)) for t in tokens]
    start = [torch.randn(n, k, generator=g) for _ in tokens]
    ref = [s + dy.t.T @ x.t for s, dy, x in zip(start, dys, xs)]
    return xs, dys, start, ref


def test_diagnose_handles_edge_tiles_empty_experts_and_non_finite_values():
    """An output that is not a multiple of the tile (300 x 200), an expert without tokens, NaN and Inf among the
    wrong values, and garbage no candidate fits: each gets its line, nothing raises."""
    from tools.grouped_wgrad_repeat import diagnose

    xs, dys, start, ref = _case([130, 0, 64], 300, 200)
    out = [r.clone() for r in ref]
    out[0][256:300, 128:200] = start[0][256:300, 128:200]  # the edge tile (44 x 72) never written
    out[1][0:3, 0:5] = 7.0  # the empty expert: wrong values where main_grad should be left alone
    out[2][10, 20], out[2][11, 21] = float("nan"), float("inf")
    lines = diagnose(out, ref, start, xs, dys, [0, 1, 2], most=8)
    assert len(lines) == 3
    assert lines[0].startswith("expert 0 tile (256,128): 3168 wrong values (0 NaN or Inf) in rows 44 (0-43), columns 72 (0-71)")
    assert "best match store skipped (-dW)" in lines[0]
    assert lines[1].startswith("expert 1 tile (0,0): 15 wrong values (0 NaN or Inf)") and "no token blocks" in lines[1]
    assert lines[2] == ("expert 2 tile (0,0): 2 wrong values (2 NaN or Inf) in rows 2 (10-11), columns 2 (20-21); "
                        "not fitted (values not finite)")  # fmt: skip
    garbage = [r.clone() for r in ref]
    garbage[0][200:256, 0:128] += torch.randn(56, 128, generator=torch.Generator().manual_seed(5)) * 1e6
    (line,) = diagnose(garbage, ref, start, xs, dys, [0], most=8)
    assert "no candidate fits" in line


def test_diagnose_only_explains_main_grad_output():
    from tools.grouped_wgrad_repeat import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--output", "bf16", "--diagnose", "2"])
    assert exit_info.value.code == 2
