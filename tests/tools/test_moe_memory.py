"""tools/moe_memory.py: its saved-for-backward bytes and cache size against the sizes of the documented layouts."""

from __future__ import annotations

import math

import pytest

from tools.moe_memory import main, measure, routing

MIB = 2**20


def pad4(v: int) -> int:
    return (v + 3) // 4 * 4


@pytest.mark.parametrize("skewed", [False, True])
def test_saved_bytes_and_cache_are_the_layouts_sizes(skewed):
    e, hidden, ffn, topk, tokens = 4, 256, 192, 2, 300
    r = measure(e, hidden, ffn, topk, tokens, skewed)
    counts = routing(e, tokens * topk, skewed)
    t = sum(counts)
    cap = sum(math.ceil(c / 128) * 128 for c in counts)  # each expert's columnwise segment padded to 128 tokens
    fp8 = sum(k * cap + cap // 128 * pad4(k) * 4 for k in (hidden, ffn))  # the inputs' columnwise copies + scales
    act = t * 2 * ffn * 2 + t * ffn * 2  # fc1's bf16 output (silu's and mul's input) and silu(a)
    cache = sum(
        e * (2 * n * k + math.ceil(n / 128) * pad4(math.ceil(k / 128)) * 4 + math.ceil(k / 128) * pad4(math.ceil(n / 128)) * 4)
        for n, k in ((2 * ffn, hidden), (hidden, ffn))
    )
    assert r["routed_tokens"] == t == tokens * topk
    assert r["saved_fp8"] * MIB == fp8 and r["saved_other"] * MIB == act and r["cache"] * MIB == cache
    assert r["peak"] >= r["forward_peak"] and r["forward_peak"] * MIB >= fp8 + act  # backward starts with the saved


def test_cli_prints_the_figures(capsys):
    assert main(["--experts", "2", "--hidden", "128", "--ffn", "128", "--topk", "1", "--tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "saved for backward:" in out and "weight caches:" in out and "200 routed tokens" in out
