"""Every Triton kernel compiles ahead of time for sm_90 and gfx950 with the FP8 instructions and no spills.

Runs the AOT compiler in a child process: compiled and interpreted Triton kernels do not mix.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "primus_fp8_plugin.backends.triton.aot", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(proc.stdout)
    assert out.exists(), proc.stderr
    return json.loads(out.read_text())


def test_every_kernel_compiled_for_both_targets(reports):
    kernels = {r["kernel"] for r in reports}
    assert {"blockwise_gemm[fwd]", "blockwise_gemm[wgrad]", "quantize_128x128[bf16->fp8e4nv]"} <= kernels
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


def test_gluon_gemm_compiles_for_sm90_without_spills():
    """The Hopper Gluon GEMM (every variant the backend selects, 128x128 and 128x256 tiles): FP8 wgmma,
    TMA loads and stores, mbarriers, setmaxnreg, no spills, no wgmma serialisation, fits in smem."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "primus_fp8_plugin.backends.triton.gemm_gluon"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" OK ") >= 19, proc.stdout


def test_gluon_quantizer_compiles_for_sm90_without_spills():
    """The Hopper Gluon dual quantizer (experimental, not selected by the backend: docs/PERFORMANCE.md):
    every variant its wrapper launches compiles with TMA, the saturating FP8 conversion, no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "primus_fp8_plugin.backends.triton.quantize_act_gluon"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" OK ") >= 36, proc.stdout  # 3 input dtypes x 2 FP8 x pow2 on/off x 3 modes
