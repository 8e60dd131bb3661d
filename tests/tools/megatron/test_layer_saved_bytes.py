"""tools/layer_saved_bytes.py on the CPU: a small Llama-style layer of the fast spec (reference backend) and of
Megatron's local spec, every saved storage attributed to the autograd node holding it and counted once."""

from __future__ import annotations

import json
import os

import pytest

from tools import layer_saved_bytes as tool

ARGS = ["--hidden", "256", "--ffn", "512", "--heads", "4", "--groups", "2", "--seq", "128", "--batch", "2", "--device", "cpu"]


@pytest.fixture
def world():
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    init_cpu_distributed(port=int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")))


def _args():
    import argparse

    return argparse.Namespace(hidden=256, ffn=512, heads=4, groups=2, seq=128, batch=2, device="cpu")


def test_fast_spec_inventory_is_attributed_and_saves_no_qkv_buffer(world):
    res = tool.measure(_args(), "fast")
    rows, tokens, hidden = res["rows"], 256, 256
    assert res["total_bytes"] == sum(r["bytes"] for r in rows) and res["tokens"] == tokens
    assert all(r["held_by"] != ["?"] for r in rows), [r for r in rows if r["held_by"] == ["?"]]
    held = {n for r in rows for n in r["held_by"]}
    assert any("Attention" in n for n in held) and "_RopeFnBackward" in held
    qkv_bytes = tokens * (hidden + 2 * 2 * (hidden // 4)) * 2  # the fused QKV projection's bf16 output
    assert all(r["bytes"] != qkv_bytes for r in rows), "SDPA's value view keeps the QKV output alive"
    fp8 = sum(r["bytes"] for r in rows if r["dtype"].startswith("float8"))
    # qkv, fc1 (hidden wide) and fc2 (ffn 512 wide) save FP8 columnwise inputs; the output projection keeps
    # the attention output SDPA saves anyway (one storage held by both nodes) and saves no FP8 copy
    assert fp8 == tokens * (2 * hidden + 512), "exactly the FP8 columnwise inputs of qkv, fc1 and fc2"
    by_proj = [r for r in rows if "_Fp8LinearFnBackward" in r["held_by"]]
    attn_out = [r for r in by_proj if any("Attention" in n for n in r["held_by"])]
    assert len(attn_out) == 1 and attn_out[0]["bytes"] == tokens * hidden * 2, rows
    assert any(r["bytes"] == tokens * 2 * 512 * 2 and r["dtype"] == "bfloat16" for r in rows), "fc1's bf16 output"


def test_cli_prints_both_specs_and_their_difference(world, capsys, tmp_path):
    out = tmp_path / "saved.json"
    assert tool.main(["--specs", "fast", "local", *ARGS, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fast:" in text and "local:" in text and "fast - local:" in text
    data = json.loads(out.read_text())
    assert [r["spec"] for r in data["results"]] == ["fast", "local"]
    assert data["results"][0]["total_bytes"] < data["results"][1]["total_bytes"], "FP8 copies below BF16 saves"


def test_te_spec_on_a_cpu_is_refused(capsys):
    with pytest.raises(SystemExit) as err:
        tool.main(["--specs", "te", *ARGS])
    assert err.value.code == 2 and "needs a GPU" in capsys.readouterr().err
