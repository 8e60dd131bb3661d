"""Compile the FlyDSL GEMMs for gfx950 without a GPU and check the ISA.

    python -m tools.aot_flydsl [--json FILE]

For fprop/dgrad (B 128x128-scaled) and wgrad (B 1x128-scaled), bf16 and fp32 outputs: the target is
gfx950, the FP8 MFMA is there, nothing spills, registers and LDS fit gfx950 (512 VGPRs incl.
AGPRs per wave, 160 KiB LDS per workgroup). Needs ``apt-get install lld-19 rocm-device-libs``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from primus_fp8_plugin.backends.flydsl.toolchain import setup_compile_only

VARIANTS = {  # name -> (M, N, K, b_block_dim, out_bf16)
    "fwd/dgrad bf16 out": (256, 256, 1024, 2, True),
    "fwd/dgrad fp32 out": (256, 384, 640, 2, False),
    "wgrad fp32 out": (256, 256, 1024, 1, False),
}


def isa_report(path: Path) -> dict:
    text = path.read_text()

    def meta(key: str) -> int:
        m = re.search(rf"^\s*-?\s*\.{key}:\s+(\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    target = re.search(r'\.amdgcn_target\s+"([^"]+)"', text)
    mfma = {}
    for mnemonic in re.findall(r"^\s*(v_mfma\w*)", text, re.M):
        mfma[mnemonic] = mfma.get(mnemonic, 0) + 1
    return {
        "target": target.group(1) if target else "",
        "vgpr": meta("vgpr_count"),
        "agpr": meta("agpr_count"),
        "sgpr": meta("sgpr_count"),
        "vgpr_spills": meta("vgpr_spill_count"),
        "sgpr_spills": meta("sgpr_spill_count"),
        "lds_bytes": meta("group_segment_fixed_size"),
        "scratch_bytes": meta("private_segment_fixed_size"),
        "mfma": mfma,
    }


def check(report: dict) -> list[str]:
    problems = []
    if not report["target"].endswith("gfx950"):
        problems.append(f"target is {report['target']!r}, not gfx950")
    if not any("f8" in k for k in report["mfma"]):
        problems.append(f"no FP8 MFMA in the ISA (found {report['mfma']})")
    if report["vgpr_spills"] or report["scratch_bytes"]:
        problems.append(f"spills: {report['vgpr_spills']} VGPRs, {report['scratch_bytes']} scratch bytes")
    if report["vgpr"] + report["agpr"] > 512 or report["lds_bytes"] > 160 * 1024:
        problems.append("registers or LDS exceed gfx950's limits")
    return problems


def run_all(dump_dir: Path | None = None) -> dict[str, dict]:
    dump = setup_compile_only("gfx950", dump_dir)
    import flydsl.compiler as flyc
    import torch

    from primus_fp8_plugin.backends.flydsl.gemm import build_kernel

    reports = {}
    for name, (m, n, k, b_dim, bf16) in VARIANTS.items():
        kb = k // 128
        a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
        b = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        c = torch.zeros(m, n, dtype=torch.bfloat16 if bf16 else torch.float32)
        sa = torch.ones(kb, -(-m // 4) * 4)  # TE 1D layout [KB, pad4(M)]
        sb = torch.ones(kb, -(-n // 4) * 4) if b_dim == 1 else torch.ones(n // 128, -(-kb // 4) * 4)  # TE 2D: [NB, pad4(KB)]
        launch = build_kernel(m, n, k, b_block_dim=b_dim, a_scale_stride=sa.stride(0), b_scale_stride=sb.stride(0), out_bf16=bf16)
        t = flyc.from_torch_tensor
        flyc.compile(launch, t(a), t(b), t(c), t(sa), t(sb))
        isa = sorted(Path(dump).glob("fp8_blockwise_gemm_kernel*/*final_isa.s"), key=lambda p: p.stat().st_mtime)[-1]
        reports[name] = isa_report(isa) | {"shape": [m, n, k], "b_block_dim": b_dim}
        reports[name]["problems"] = check(reports[name])
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    reports = run_all()
    for name, r in reports.items():
        status = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        print(f"{name:20} {r['target']:36} VGPR {r['vgpr']:3} AGPR {r['agpr']:3} SGPR {r['sgpr']:3} "
              f"LDS {r['lds_bytes']:6} scratch {r['scratch_bytes']} mfma {r['mfma']}  {status}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 1 if any(r["problems"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
