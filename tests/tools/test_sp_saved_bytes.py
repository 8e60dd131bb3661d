"""tools/sp_saved_bytes.py at TP=2 (gloo processes on the CPU, small widths): each figure is the size of what the
layer is documented to save, per rank, under sequence parallelism."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from tools.sp_saved_bytes import MIB, main, measure  # noqa: E402

PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 70


def fp8_columnwise(m: int, k: int) -> int:
    """An [m, k] input's columnwise FP8 copy: [k, m] bytes, fp32 scales [m/128, pad4(k)]."""
    return m * k + m // 128 * ((k + 3) // 4 * 4) * 4


def test_saved_bytes_are_the_layouts_sizes():
    tp, hidden, ffn, heads, groups, tokens = 2, 256, 384, 4, 2, 512
    rows = {r["linear"]: r for r in measure(tp, hidden, ffn, heads, groups, tokens, PORT)}
    m = tokens // tp
    for name, k, col in (("linear_qkv", hidden, True), ("linear_proj", hidden, False), ("linear_fc1", hidden, True),
                         ("linear_fc2", ffn, False)):  # fmt: skip
        r = rows[name]
        if col:  # the local shard: bf16 (Megatron), FP8 (plugin), the gathered sequence in FP8 (before)
            want = (m * k * 2, fp8_columnwise(m, k), fp8_columnwise(tokens, k))
        else:  # all tokens, this rank's features
            want = (tokens * (k // tp) * 2, fp8_columnwise(tokens, k // tp), fp8_columnwise(tokens, k // tp))
        got = tuple(r[c] * MIB for c in ("megatron_bf16", "plugin", "plugin_bf16_gather"))
        assert got == want, (name, got, want)
    assert rows["total"]["plugin"] == sum(rows[n]["plugin"] for n in rows if n != "total")


def test_cli_prints_the_table(capsys):
    args = ["--tp", "2", "--tokens", "256", "--hidden", "128", "--ffn", "256", "--heads", "2", "--groups", "1"]
    assert main([*args, "--port", str(PORT + 1)]) == 0
    out = capsys.readouterr().out
    assert "megatron_bf16" in out and "linear_fc2" in out and out.count("\n  2  ") == 5
