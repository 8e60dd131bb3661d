"""Every Triton kernel compiles ahead of time for sm_90 and gfx950 with the FP8 instructions and no spills.

Runs the AOT compiler in a child process: compiled and interpreted Triton kernels do not mix.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot_triton", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout)
    assert out.exists(), proc.stderr
    return json.loads(out.read_text())


def test_every_kernel_compiled_for_both_targets(reports):
    import tools.aot_specs_fused as aot_fused

    kernels = {r["kernel"] for r in reports}
    assert {"blockwise_gemm[fwd]", "blockwise_gemm[wgrad]", "quantize_128x128[bf16->fp8e4nv]", "transpose_128x128[u8]"} <= kernels
    grouped = {"grouped_gemm[fwd]", "grouped_gemm[dgrad]", "grouped_wgrad[main_grad,64x64]", "grouped_wgrad[main_grad,128x128]"}
    grouped |= {"quantize_128x128_batched[bf16->fp8e4nv,table]"}
    assert grouped <= kernels and any(k.startswith("quantize_grouped_1x128[") for k in kernels)  # the MoE kernels
    assert {spec["name"] for spec in aot_fused.kernel_specs()} <= kernels  # norm, SwiGLU, RoPE (no FMA, checked below)
    for k in kernels:
        assert {r["target"] for r in reports if r["kernel"] == k} == {"sm90", "gfx950"}


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_fp8_instructions_present(reports, target):
    for r in (r for r in reports if r["target"] == target):
        assert r["found"] and all(r["found"].values()), f"{r['kernel']} on {target}: {r['found']}"


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_no_register_spills_and_resources_fit(reports, target):
    smem_limit = {"sm90": 227 * 1024, "gfx950": 160 * 1024}[target]
    reg_limit = {"sm90": 255, "gfx950": 512}[target]
    for r in (r for r in reports if r["target"] == target):
        assert r["spill_bytes"] == 0 and r["vgpr_spills"] == 0, r
        assert 0 < r["registers"] <= reg_limit and r["shared_bytes"] <= smem_limit, r


# (module, variants its AOT check must pass at least): the Hopper Gluon GEMM, every variant the backend
# selects (128x128 and 128x256 tiles: FP8 wgmma, TMA, mbarriers, setmaxnreg, no wgmma serialisation);
# the Hopper Gluon quantizers, every variant (activations: 3 input dtypes x 2 FP8 types x pow2 on/off
# x 3 row/column modes; weights: the same with 2 tile orders instead of modes): the saturating FP8
# conversion, 16 wide (4- to 16-byte) transposing shared-memory stores per thread, no byte-wise or
# 16-bit shared traffic, no undefined PTX registers (a Triton miscompile their first version hit).
# All: no spills, shared memory fits.
# The Hopper fused quantizer (norm / SwiGLU producer + the act quantizer), 12 variants: the same checks,
# and no FMA contracted in its PTX.
GLUON_KERNELS = [("gemm", 19), ("grouped", 7), ("quantize_act", 36), ("quantize_weight", 24), ("fused_act", 12)]


@pytest.mark.parametrize("module, variants", GLUON_KERNELS, ids=[m for m, _ in GLUON_KERNELS])
def test_gluon_kernels_compile_for_sm90_without_spills(module, variants):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot_triton", "--gluon", module],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" OK ") >= variants, proc.stdout


def test_undefined_register_scan_finds_a_read_of_an_unwritten_register():
    """The guard of the Gluon quantizers' AOT check, on PTX shaped like Triton's miscompile (a byte
    of each W^T word packed from a register nothing writes) and on its fixed form."""
    from tools.aot_triton import undefined_registers

    bad = """
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    cvt.rn.satfinite.e4m3x2.f32  %rs1, %r2, %r1;
    cvt.u32.u16 %r447, %rs1;
    prmt.b32 %r448, %r447, %r449, 0x3340U;
    @%p3 st.shared.b32 [ %r34 + 0 ], %r448;
    """
    assert undefined_registers(bad) == {"%r449", "%rd1", "%r34"}  # the predicate is not an operand
    fixed = bad.replace("%r449", "%r3").replace("[ %rd1", "[ %rd0").replace("[ %r34", "[ %r4")
    assert undefined_registers("mov.u64 %rd0, 0;\n" + fixed) == set()


def test_fingerprints_ignore_addresses_encodings_and_debug_lines():
    """fingerprint.py hashes instructions only: the same code at other addresses, with other
    encodings or source lines, has the same fingerprint; one changed operand changes it."""
    from tools.fingerprint import _digest, amdgcn_instructions, compare, renamed, sass_instructions

    sass_a = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 BRA 0x120 ;                                   /* 0x000000000000794d */
    """
    sass_b = sass_a.replace("/*0000*/", "/*0f00*/").replace("0x00000a00ff017b82", "0x1111111111111111")
    assert sass_instructions(sass_a) == ["LDC R1, c[0x0][0x28]", "@!P0 BRA 0x120"]
    assert _digest(sass_instructions(sass_a)) == _digest(sass_instructions(sass_b))
    assert _digest(sass_instructions(sass_a)) != _digest(sass_instructions(sass_a.replace("R1,", "R2,")))
    gcn = '\t.loc 1 42 7\n.LBB0_1:\n\tv_mul_f32_e32 v1, v2, v3 ; comment\n\t.file 1 "x.py"\n\ts_endpgm\n'
    assert amdgcn_instructions(gcn) == ["v_mul_f32_e32 v1, v2, v3", "s_endpgm"]
    assert compare({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["changed  b", "added    c"]
    # a renamed variant compares with its new name; a rename that does not apply changes nothing
    assert renamed({"g[n256:b1d]": "1", "q[x]": "2"}, ["n256:=128x256:", "zz=yy"]) == {"g[128x256:b1d]": "1", "q[x]": "2"}
    assert compare(renamed({"g[n256]": "1"}, ["n256=128x256"]), {"g[128x256]": "1"}) == []
