"""What FlyDSL needs to compile for gfx950 on a machine without ROCm: an ``ld.lld`` and the AMD
device bitcode under ``$ROCM_PATH`` (docs/AMD.md). On Debian they come from the packages ``lld-19``
and ``rocm-device-libs``; this module lays them out as a minimal ROCm root and sets the variables
FlyDSL reads for compile-only runs. Must run before flydsl is imported.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LLD_CANDIDATES = ("/opt/rocm/llvm/bin/ld.lld", "/usr/lib/llvm-19/bin/ld.lld", "/usr/bin/ld.lld-19", "/usr/bin/ld.lld")
BITCODE_CANDIDATES = ("/opt/rocm/amdgcn/bitcode", "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")


class ToolchainMissing(RuntimeError):
    """No ld.lld or no AMD device bitcode: says which Debian package provides it."""


def _find(candidates, what: str, package: str) -> str:
    for c in candidates:
        if os.path.exists(c):
            return c
    if what == "bitcode":
        try:
            out = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=False).stdout
            for line in out.splitlines():
                if line.endswith(".bc"):
                    return str(Path(line).parent)
        except FileNotFoundError:
            pass
    raise ToolchainMissing(f"no {what} found; install it with `apt-get install -y {package}` (or ROCm)")


def rocm_root(cache_dir: str | Path | None = None) -> Path:
    """A directory with ``llvm/bin/ld.lld`` and ``amdgcn/bitcode``: ``$ROCM_PATH`` if it has them,
    else a root of symlinks made under ``cache_dir`` (default ``~/.cache/primus_fp8_plugin/rocm``)."""
    env = os.environ.get("ROCM_PATH")
    if env and (Path(env) / "llvm/bin/ld.lld").exists() and (Path(env) / "amdgcn/bitcode").exists():
        return Path(env)
    root = Path(cache_dir or Path.home() / ".cache/primus_fp8_plugin/rocm")
    lld, bitcode = root / "llvm/bin/ld.lld", root / "amdgcn/bitcode"
    if not lld.exists():
        lld.parent.mkdir(parents=True, exist_ok=True)
        lld.symlink_to(_find(LLD_CANDIDATES, "ld.lld", "lld-19"))
    if not bitcode.exists():
        bitcode.parent.mkdir(parents=True, exist_ok=True)
        bitcode.symlink_to(_find(BITCODE_CANDIDATES, "bitcode", "rocm-device-libs"))
    return root


def setup_compile_only(arch: str = "gfx950", dump_dir: str | Path | None = None) -> Path:
    """Environment for compiling (never launching) FlyDSL kernels for ``arch``; returns the ISA dump dir.

    Without ``ARCH``/``FLYDSL_GPU_ARCH`` FlyDSL silently targets gfx942, so both are set and the
    caller should assert the target line of the ISA."""
    dump = Path(dump_dir or Path.home() / ".cache/primus_fp8_plugin/flydsl_isa")
    os.environ.update(
        ROCM_PATH=str(rocm_root()),
        COMPILE_ONLY="1",
        ARCH=arch,
        FLYDSL_GPU_ARCH=arch,
        FLYDSL_DEBUG_DUMP_ASM="1",
        FLYDSL_DUMP_DIR=str(dump),
    )
    return dump
