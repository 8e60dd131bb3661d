"""Development tool (not CI): compile Primus-Turbo's FlyDSL blockwise FP8 GEMMs for gfx950 under
flydsl 0.2.4 and print their ISA columns next to ours (``tools/aot_flydsl.py``).

    python -m tools.anchor_flydsl_isa --primus PATH_TO_PRIMUS_TURBO_CHECKOUT [--venv DIR] [--json FILE]

``PATH`` is a Primus-Turbo checkout whose ``primus_turbo/flydsl/gemm/gemm_fp8_blockwise_kernel.py``
holds the 4-wave / 8-wave blockwise kernels (``compile_blockscale_fp8_gemm_4w`` and friends; the file
left Primus-Turbo's main branch later: ``git archive 5f8c43fb primus_turbo | tar -x -C DIR`` gives the
tree the docs/AMD.md figures come from). The
kernels need flydsl 0.2.4, which cannot share a process with this project's flydsl 0.5: the tool
makes a virtualenv (default ``~/.cache/primus_fp8_plugin/flydsl-0.2.4``) with ``pip install
flydsl==0.2.4 --no-deps``, lets it see this interpreter's torch/numpy through a ``.pth`` file (the
venv's own flydsl comes first on ``sys.path``), and compiles each variant there in a child process with
``COMPILE_ONLY=1 ARCH=gfx950`` and the compile-only ROCm root of ``tools/flydsl_toolchain.py``.
Each variant is compiled at M, N, K = 256, 512, 1024 with the kernel's own defaults; the table
columns are those of ``tools/flydsl_isa.py`` (its docstring defines the occupancy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from tools.flydsl_isa import header, isa_report, row
from tools.flydsl_toolchain import rocm_root

M, N, K = 256, 512, 1024
KB = K // 128
# name -> (compile function, its kwargs, waves, A shape, B shape, A-scale shape, B-scale shape)
VARIANTS = {
    "turbo fwd 4w bm128": ("compile_blockscale_fp8_gemm_4w", {"BLOCK_M": 128}, 4, (M, K), (N, K), (KB, M), (N // 128, KB)),
    "turbo fwd 4w bm192": ("compile_blockscale_fp8_gemm_4w", {"BLOCK_M": 192}, 4, (M, K), (N, K), (KB, M), (N // 128, KB)),
    "turbo fwd 8w 3-stage": ("compile_blockscale_fp8_gemm_8w_3stage", {"scale_a_k_major": True}, 8, (M, K), (N, K), (KB, M),
                             (N // 128, KB)),
    "turbo dgrad nn physical 4w": ("compile_blockscale_fp8_gemm_nn_physical_4w", {}, 4, (M, K), (K, N), (KB, M),
                                   (KB, N // 128)),
    "turbo dgrad nn fused 8w": ("compile_blockscale_fp8_gemm_nn_fused_8w", {}, 8, (M, K), (K, N), (KB, M), (N // 128, KB)),
    "turbo wgrad tn physical 4w": ("compile_blockscale_fp8_gemm_tn_physical_4w", {}, 4, (K, M), (K, N), (KB, M), (KB, N)),
}  # fmt: skip

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import flydsl
import flydsl.compiler as flyc
from primus_turbo.flydsl.gemm import gemm_fp8_blockwise_kernel as G
fn, kwargs, a, b, sa, sb, (M, N, K) = json.loads(sys.argv[2])
assert flydsl.__version__.startswith(sys.argv[3]), flydsl.__version__
launch = getattr(G, fn)(M=M, N=N, K=K, **kwargs)
i8 = torch.int8
args = (torch.zeros(*a, dtype=i8), torch.zeros(*b, dtype=i8), torch.zeros(M, N, dtype=torch.bfloat16),
        torch.ones(*sa), torch.ones(*sb), None)
flyc.compile(launch, *args)
"""


def ensure_venv(venv: Path, version: str) -> Path:
    """The virtualenv's python, with flydsl ``version`` installed and this interpreter's torch visible."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    have = subprocess.run([str(py), "-c", "import flydsl; print(flydsl.__version__)"], capture_output=True, text=True)
    if have.returncode != 0 or not have.stdout.strip().startswith(version):
        subprocess.run([str(py), "-m", "pip", "install", "--no-deps", f"flydsl=={version}"], check=True)
    site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    (Path(site) / "zz_host_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def compile_variant(py: Path, primus: Path, spec: tuple, dump: Path, version: str) -> tuple[str | None, str]:
    """(the final ISA text or None, the child's error output)."""
    fn, kwargs, waves, a, b, sa, sb = spec
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ROCM_PATH=str(rocm_root()), COMPILE_ONLY="1", ARCH="gfx950", FLYDSL_GPU_ARCH="gfx950",
               FLYDSL_DUMP_IR="1", FLYDSL_DUMP_DIR=str(dump))  # fmt: skip
    spec_json = json.dumps([fn, kwargs, a, b, sa, sb, [M, N, K]])
    proc = subprocess.run([str(py), "-c", CHILD, str(primus), spec_json, version], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    # flydsl 0.2.4 compiles, then tries to load the HIP runtime and aborts: the ISA is already written
    isas = sorted(dump.glob("*/*final_isa.s"), key=lambda p: p.stat().st_mtime)
    return (isas[-1].read_text() if isas else None), proc.stderr[-2000:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--primus", type=Path, required=True, help="a Primus-Turbo checkout (its root directory)")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/primus_fp8_plugin/flydsl-0.2.4")
    ap.add_argument("--flydsl-version", default="0.2.4")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    kernel_file = args.primus / "primus_turbo/flydsl/gemm/gemm_fp8_blockwise_kernel.py"
    if not kernel_file.exists():
        ap.error(f"{kernel_file} not found: --primus must be a Primus-Turbo checkout with the FlyDSL blockwise kernels "
                 "(e.g. commit 5f8c43fb; later commits removed the file)")  # fmt: skip
    py = ensure_venv(args.venv, args.flydsl_version)
    reports: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in VARIANTS.items():
            text, err = compile_variant(py, args.primus.resolve(), spec, Path(tmp) / name.replace(" ", "_"), args.flydsl_version)
            if text is None:
                print(f"{name}: did not compile: {err}", file=sys.stderr)
                continue
            reports[name] = isa_report(text, waves_per_workgroup=spec[2]) | {"b_layout": "k_major", "shape": [M, N, K]}
    from tools.aot_flydsl import run_all

    ours = {f"ours {n}": r for n, r in run_all().items() if r.get("family") == "lds"}
    print(header())
    for name, r in {**reports, **ours}.items():
        print(row(name, r))
    if args.json:
        args.json.write_text(json.dumps({"turbo": reports, "ours": ours}, indent=1))
    return 0 if reports else 1


if __name__ == "__main__":
    sys.exit(main())
