"""FlyDSL backend: the GEMM kernels compile for gfx950 with the FP8 MFMA, no spills, within gfx950's
registers and LDS (compile-only: no AMD GPU); elsewhere the backend says why it is unavailable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primus_fp8_plugin import backend_availability

ROOT = Path(__file__).resolve().parents[2]


def test_unavailable_off_amd_with_a_reason():
    avail = backend_availability("flydsl", "cpu")
    assert not avail
    assert "AMD" in avail.reason or "flydsl" in avail.reason


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    pytest.importorskip("flydsl")
    from primus_fp8_plugin.backends.flydsl.toolchain import ToolchainMissing, rocm_root

    try:
        rocm_root(tmp_path_factory.mktemp("rocm"))
    except ToolchainMissing as err:
        pytest.fail(f"the test set-up should have installed the gfx950 toolchain: {err}")
    out = tmp_path_factory.mktemp("flydsl") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tools.aot_flydsl", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_gemm_variant_compiles_for_gfx950_with_fp8_mfma(reports):
    assert set(reports) == {"fwd/dgrad bf16 out", "fwd/dgrad fp32 out", "wgrad fp32 out"}
    for name, r in reports.items():
        assert r["target"].endswith("gfx950"), name
        assert r["mfma"].get("v_mfma_f32_16x16x128_f8f6f4", 0) + r["mfma"].get("v_mfma_scale_f32_16x16x128_f8f6f4", 0) > 0, r


def test_no_spills_and_resources_fit_gfx950(reports):
    for name, r in reports.items():
        assert r["problems"] == [], (name, r["problems"])
        assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0
        assert 0 < r["vgpr"] + r["agpr"] <= 512 and r["lds_bytes"] <= 160 * 1024


def test_missing_toolchain_names_the_package(tmp_path, monkeypatch):
    from primus_fp8_plugin.backends.flydsl import toolchain

    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(toolchain, "LLD_CANDIDATES", (str(tmp_path / "no-lld"),))
    with pytest.raises(toolchain.ToolchainMissing, match="apt-get install -y lld-19"):
        toolchain.rocm_root(tmp_path / "root")
