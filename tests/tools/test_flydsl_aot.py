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
    from tools.flydsl_toolchain import ToolchainMissing, rocm_root

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


DIRECT = {"fwd/dgrad bf16 out", "fwd/dgrad fp32 out", "wgrad fp32 out"}
LDS = {
    "lds fwd/dgrad 128x128 w4",
    "lds fwd/dgrad 128x256 w8",
    "lds wgrad 256x128 w8",
    "lds wgrad 256x128 w8 ragged M",
    "lds dgrad 128x256 w8 K-padded",
}


def test_every_gemm_variant_compiles_for_gfx950_with_fp8_mfma(reports):
    assert set(reports) == DIRECT | LDS
    for name, r in reports.items():
        assert r["target"].endswith("gfx950"), name
        assert r["mfma"].get("v_mfma_f32_16x16x128_f8f6f4", 0) + r["mfma"].get("v_mfma_scale_f32_16x16x128_f8f6f4", 0) > 0, r


def test_no_spills_and_resources_fit_gfx950(reports):
    for name, r in reports.items():
        assert r["problems"] == [], (name, r["problems"])
        assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0
        assert 0 < r["vgpr"] + r["agpr"] <= 512 and r["lds_bytes"] <= 160 * 1024


def test_preshuffled_kernels_stage_a_through_lds(reports):
    pre = [n for n in LDS if reports[n]["b_layout"] == "preshuffle16"]
    assert len(pre) == 3
    for name in LDS:
        r = reports[name]
        loop = r["k_loop"]
        assert r["lds_bytes"] > 0 and loop["lds"] > 0, name  # A (and wgrad's B) go through LDS
        assert loop["mfma"] >= 32 and loop["vmem"] > 0, (name, loop)  # two 128-K steps of 16 MFMAs per trip
        assert r["occupancy"] >= 2, (name, r["occupancy"])


def test_lds_kernels_at_least_match_primus_turbo(reports):
    """The static comparison's goal (docs/AMD.md): per K-loop trip at least the anchor's MFMAs, at most
    its VALU per MFMA, an occupancy at least its own (tools.aot_flydsl.ANCHOR, from
    tools.anchor_flydsl_isa)."""
    from tools.aot_flydsl import ANCHOR

    for name in LDS:
        r = reports[name]
        anchor = ANCHOR[r["b_layout"]]
        assert r["valu_per_mfma"] <= anchor["valu_per_mfma"], (name, r["valu_per_mfma"], r["k_loop"])
        assert r["k_loop"]["mfma"] >= anchor["loop_mfma"] and r["occupancy"] >= anchor["occupancy"], (name, r)


def test_anchor_check_flags_a_regression():
    from tools.aot_flydsl import check

    r = {"target": "amdgcn-amd-amdhsa--gfx950", "mfma": {"v_mfma_f32_16x16x128_f8f6f4": 64}, "vgpr_spills": 0,
         "scratch_bytes": 0, "vgpr": 200, "agpr": 0, "lds_bytes": 32768, "b_layout": "preshuffle16", "occupancy": 2,
         "k_loop": {"mfma": 64, "valu": 64 * 3.6, "vmem": 1, "lds": 1, "salu": 1}, "valu_per_mfma": 3.6}  # fmt: skip
    assert any("VALU per MFMA" in p for p in check(r, lds_kernel=True))
    assert check(r | {"valu_per_mfma": 3.0}, lds_kernel=True) == []


def test_occupancy_formula():
    from tools.flydsl_isa import occupancy

    # 4 waves (one per SIMD): registers allow 512 // ceil8(vgpr) waves, LDS 160 KiB // lds workgroups
    assert occupancy(182, 0, 64 * 1024, 4) == 2  # 512 // 184 = 2; LDS: 2 workgroups
    assert occupancy(256, 0, 32 * 1024, 4) == 2
    assert occupancy(257, 0, 0, 4) == 1  # 264 registers
    assert occupancy(128, 128, 0, 4) == 2  # AGPRs share the 512
    assert occupancy(64, 0, 0, 4) == 8  # capped at 8
    assert occupancy(100, 0, 96 * 1024, 8) == 2  # 8 waves = 2 per SIMD; one workgroup fits the LDS
    assert occupancy(100, 0, 0, 8) == 4  # 512 // 104 = 4 waves: two workgroups


def test_k_loop_counts_on_a_listing():
    from tools.flydsl_isa import isa_report

    text = """
    .amdgcn_target "amdgcn-amd-amdhsa--gfx950"
    s_mov_b32 s0, 0
.LBB0_1:
    buffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen
    ds_read_b128 v[8:11], v12
    v_mfma_f32_16x16x128_f8f6f4 v[16:19], v[20:27], v[28:35], 0
    v_mfma_f32_16x16x128_f8f6f4 v[36:39], v[20:27], v[28:35], 0
    v_pk_fma_f32 v[40:41], v[16:17], v[8:9], v[40:41]
    s_add_i32 s0, s0, 1
    s_cbranch_scc1 .LBB0_1
    v_mfma_f32_16x16x128_f8f6f4 v[16:19], v[20:27], v[28:35], 0
    s_endpgm
    .vgpr_count:     42
    .agpr_count:     0
    .group_segment_fixed_size: 1024
"""
    r = isa_report(text, waves_per_workgroup=4, dynamic_lds_bytes=1024)
    assert r["k_loop"] == {"mfma": 2, "valu": 1, "vmem": 1, "lds": 1, "salu": 2}
    assert r["mfma_total"] == 3 and r["lds_bytes"] == 2048 and r["valu_per_mfma"] == 0.5 and r["vgpr"] == 42


def test_missing_toolchain_names_the_package(tmp_path, monkeypatch):
    import tools.flydsl_toolchain as toolchain

    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(toolchain, "LLD_CANDIDATES", (str(tmp_path / "no-lld"),))
    with pytest.raises(toolchain.ToolchainMissing, match="apt-get install -y lld-19"):
        toolchain.rocm_root(tmp_path / "root")
