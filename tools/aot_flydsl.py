"""Compile the FlyDSL GEMMs for gfx950 without a GPU and report their ISA.

    python -m tools.aot_flydsl [--json FILE]

Variants (M, N, K = 256, 512, 1024 unless stated): the direct-load kernel (``kernels/gfx950/gemm.py``:
K-major B, 64x64 tiles, fprop/dgrad bf16 and fp32 out, wgrad) and the LDS-staged kernels
(``kernels/gfx950/gemm_lds.py``): fprop/dgrad reading the preshuffled weight (128x128 / 4 waves, 128x256 /
8 waves; and dgrad on a W^T padded from 384 to 512 rows, its 384 output columns stored), wgrad
256x128 / 8 waves with K-major B (whole, and with a ragged last M tile). Per variant: ``b_layout``,
registers, LDS (static + dynamic), spills, MFMA count, the K loop's MFMA / VALU / vector-memory / LDS
instructions per trip and the occupancy the resources allow (``tools/flydsl_isa.py`` states the
formula). Checks: target gfx950, the FP8 MFMA present, no spills or scratch, registers and LDS within
gfx950's limits; for the LDS kernels LDS in use and at least Primus-Turbo's figures (``ANCHOR``).
Needs ``apt-get install lld-19 rocm-device-libs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.flydsl_isa import header, isa_report, row
from tools.flydsl_toolchain import setup_compile_only

SHAPE = (256, 512, 1024)  # M, N, K
DIRECT = {  # name -> (M, N, K, b_block_dim, out_bf16)
    "fwd/dgrad bf16 out": (256, 256, 1024, 2, True),
    "fwd/dgrad fp32 out": (256, 384, 640, 2, False),
    "wgrad fp32 out": (256, 256, 1024, 1, False),
}
LDS = {  # name -> (config name in kernels/gfx950/heuristics.py, out_bf16, M)
    "lds fwd/dgrad 128x128 w4": ("FWD_128x128", True, 256),
    "lds fwd/dgrad 128x256 w8": ("FWD_128x256", True, 256),
    "lds wgrad 256x128 w8": ("WGRAD_256x128", False, 256),
    "lds wgrad 256x128 w8 ragged M": ("WGRAD_256x128", False, 384),  # a masked last M tile
    "lds dgrad 128x256 w8 K-padded": ("FWD_128x256", True, 256),  # W^T padded 384 -> 512 rows: C has 384 columns
}
N_VALID = {"lds dgrad 128x256 w8 K-padded": 384}
# Primus-Turbo's best figures in the static comparison (tools/anchor_flydsl_isa.py, flydsl 0.2.4, M, N, K =
# 256, 512, 1024; docs/AMD.md): the LDS kernels must do at least as well. fprop/dgrad: their lowest VALU per
# MFMA (BLOCK_M-192 fprop 3.48, physical-NN dgrad 3.47) and their most MFMAs per K-loop trip (48); wgrad:
# their 1x128 x 1x128 wgrad (5.16, 32).
ANCHOR = {"preshuffle16": {"valu_per_mfma": 3.47, "loop_mfma": 48, "occupancy": 2},
          "k_major": {"valu_per_mfma": 5.16, "loop_mfma": 32, "occupancy": 2}}  # fmt: skip


def check(report: dict, *, lds_kernel: bool) -> list[str]:
    problems = []
    if not report["target"].endswith("gfx950"):
        problems.append(f"target is {report['target']!r}, not gfx950")
    if not any("f8" in k for k in report["mfma"]):
        problems.append(f"no FP8 MFMA in the ISA (found {report['mfma']})")
    if report["vgpr_spills"] or report["scratch_bytes"]:
        problems.append(f"spills: {report['vgpr_spills']} VGPRs, {report['scratch_bytes']} scratch bytes")
    if report["vgpr"] + report["agpr"] > 512 or report["lds_bytes"] > 160 * 1024:
        problems.append("registers or LDS exceed gfx950's limits")
    if lds_kernel and (report["lds_bytes"] == 0 or report["k_loop"]["lds"] == 0):
        problems.append("the LDS-staged kernel uses no LDS in its K loop")
    anchor = ANCHOR.get(report.get("b_layout")) if lds_kernel else None
    if anchor:
        if report["valu_per_mfma"] is None or report["valu_per_mfma"] > anchor["valu_per_mfma"]:
            problems.append(f"VALU per MFMA {report['valu_per_mfma']} above Primus-Turbo's {anchor['valu_per_mfma']}")
        if report["k_loop"]["mfma"] < anchor["loop_mfma"]:
            problems.append(f"{report['k_loop']['mfma']} MFMAs per K-loop trip, below Primus-Turbo's {anchor['loop_mfma']}")
        if report["occupancy"] < anchor["occupancy"]:
            problems.append(f"occupancy {report['occupancy']} below Primus-Turbo's {anchor['occupancy']}")
    return problems


def _latest(dump: Path, kernel: str) -> str:
    isa = sorted(Path(dump).glob(f"{kernel}*/*final_isa.s"), key=lambda p: p.stat().st_mtime)[-1]
    return isa.read_text()


def run_all(dump_dir: Path | None = None) -> dict[str, dict]:
    dump = setup_compile_only("gfx950", dump_dir)
    import flydsl.compiler as flyc
    import torch

    from primus_fp8_plugin.kernels.gfx950 import gemm_lds, heuristics
    from primus_fp8_plugin.kernels.gfx950.gemm import THREADS, build_kernel

    f8 = torch.float8_e4m3fn
    reports = {}
    for name, (m, n, k, b_dim, bf16) in DIRECT.items():
        kb = k // 128
        a, b = torch.zeros(m, k, dtype=f8), torch.zeros(n, k, dtype=f8)
        c = torch.zeros(m, n, dtype=torch.bfloat16 if bf16 else torch.float32)
        sa = torch.ones(kb, -(-m // 4) * 4)  # TE 1D layout [KB, pad4(M)]
        sb = torch.ones(kb, -(-n // 4) * 4) if b_dim == 1 else torch.ones(n // 128, -(-kb // 4) * 4)  # TE 2D: [NB, pad4(KB)]
        launch = build_kernel(m, n, k, b_block_dim=b_dim, a_scale_stride=sa.stride(0), b_scale_stride=sb.stride(0), out_bf16=bf16)
        t = flyc.from_torch_tensor
        flyc.compile(launch, t(a), t(b), t(c), t(sa), t(sb))
        r = isa_report(_latest(dump, "fp8_blockwise_gemm_kernel"), waves_per_workgroup=THREADS // 64)
        reports[name] = r | {"shape": [m, n, k], "b_block_dim": b_dim, "b_layout": "k_major", "family": "direct"}
        reports[name]["problems"] = check(r, lds_kernel=False)
    _, n, k = SHAPE
    for name, (cfg_name, bf16, m) in LDS.items():
        cfg = getattr(heuristics, cfg_name)
        n_valid = N_VALID.get(name, n)
        c = torch.zeros(m, n_valid, dtype=torch.bfloat16 if bf16 else torch.float32)
        if cfg.b_layout == "preshuffle16":  # fprop/dgrad: M dynamic (compiled once per N, K)
            launch = gemm_lds.build_kernel(cfg, n, k, out_bf16=bf16, n_valid=n_valid)
            a, b = torch.zeros(m, k, dtype=f8), torch.zeros(n, k, dtype=f8)
            sa, sb = torch.ones(k // 128, m), torch.ones(n // 128, k // 128)
        else:  # wgrad: the contraction (tokens) dynamic
            launch = gemm_lds.build_kernel(cfg, n, None, m=m, out_bf16=bf16)
            a, b = torch.zeros(m, k, dtype=f8), torch.zeros(n, k, dtype=f8)
            sa, sb = torch.ones(k // 128, -(-m // 4) * 4), torch.ones(k // 128, n)
        flyc.compile(launch, *gemm_lds.dynamic_args(cfg, a, b, c, sa, sb))
        r = isa_report(_latest(dump, "fp8_blockwise_gemm_lds_kernel"), waves_per_workgroup=cfg.waves,
                       dynamic_lds_bytes=cfg.lds_bytes)  # fmt: skip
        r["b_layout"] = cfg.b_layout
        reports[name] = r | {"shape": [m, n, k], "b_block_dim": 2 if cfg.b_layout == "preshuffle16" else 1,
                             "b_layout": cfg.b_layout, "family": "lds", "tile": [cfg.bm, cfg.bn, 128]}  # fmt: skip
        reports[name]["problems"] = check(r, lds_kernel=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    reports = run_all()
    print(header())
    for name, r in reports.items():
        status = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        print(row(name, r), status)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 1 if any(r["problems"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
