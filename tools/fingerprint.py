"""Fingerprints of the compiled code of every kernel variant the backends launch, without a GPU.

A refactor that is meant to leave the kernels alone (a helper moved, an argument renamed, a branch
folded) can be checked on a CPU: compile before and after, compare. Each fingerprint is a hash of
the sm_90 SASS instructions (addresses and encodings dropped) or of the gfx950 AMDGCN instructions
(directives, comments and debug lines dropped), so source locations and file paths do not count.

    python -m tools.fingerprint --out before.json     # on the old tree
    python -m tools.fingerprint --compare before.json # on the new tree

``--compare`` lists the variants whose code changed, appeared or disappeared, and exits 1 if any
did; ``--rename OLD=NEW`` (repeatable) first replaces OLD by NEW in the earlier file's variant
names, for a refactor that renames variants. Covers the Triton kernels of
``aot_triton.kernel_specs()`` (sm_90 and gfx950) and every variant of the Hopper Gluon kernels' AOT
checks (sm_90: the dense and grouped GEMMs, the quantizers, the fused quantizer in each launch
variant). Takes about fifteen minutes on two CPU cores (it compiles everything).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

_SASS_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def sass_instructions(sass: str) -> list[str]:
    """The instruction text of each SASS line of ``cuobjdump -sass``, without address or encoding."""
    return [m.group(1) for m in map(_SASS_INSTRUCTION.match, sass.splitlines()) if m]


def amdgcn_instructions(amdgcn: str) -> list[str]:
    """The instruction lines of an AMDGCN listing (no directives, labels, comments or debug lines)."""
    out = []
    for line in amdgcn.splitlines():
        text = line.split(";")[0].strip()
        if text and not text.startswith(".") and not text.endswith(":"):
            out.append(" ".join(text.split()))
    return out


def _digest(lines: list[str]) -> str:
    if not lines:
        raise ValueError("no instructions found: the listing format changed?")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def fingerprints(verbose: bool = False) -> dict[str, str]:
    """{variant name: fingerprint} of every kernel variant (see the module docstring)."""
    import torch

    from tools import aot_triton as aot

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    out: dict[str, str] = {}

    def add(name: str, lines: list[str]) -> None:
        out[name] = _digest(lines)
        if verbose:
            print(f"{out[name]}  {name}", flush=True)

    for spec in aot.kernel_specs():
        for target in aot.TARGETS:
            _, asm = aot.compile_spec(spec, target)
            add(
                f"{spec.name}.{target}",
                sass_instructions(asm["sass"]) if target == "sm90" else amdgcn_instructions(asm["amdgcn"]),
            )
    for v in aot.gemm_aot_variants():
        _, sass = aot.sm90_resources(aot.compile_gemm(v).asm["cubin"])
        add(f"gemm_gluon[{v.name}].sm90", sass_instructions(sass))
    quantizers = {
        "quantize_act_gluon": (aot.act_quant_aot_variants, aot.compile_act_quant),
        "quantize_weight_gluon": (aot.weight_quant_aot_variants, aot.compile_weight_quant),
    }
    for module, (variants, compile_fn) in quantizers.items():
        for v in variants():
            _, sass = aot.sm90_resources(compile_fn(*v).asm["cubin"])
            tag = ",".join(aot.sig_type(x) if isinstance(x, torch.dtype) else str(x) for x in v)
            add(f"{module}[{tag}].sm90", sass_instructions(sass))
    for v in aot.grouped_gluon_variants():
        _, sass = aot.sm90_resources(aot.compile_grouped_gluon(v).asm["cubin"])
        add(f"gemm_grouped_gluon[{v[0]}].sm90", sass_instructions(sass))
        if v[1] == "wgrad" and not v[5]:  # a plain output that is not one span of memory: stores from registers
            _, sass = aot.sm90_resources(aot.compile_grouped_gluon(v, store_tma=False).asm["cubin"])
            add(f"gemm_grouped_gluon[{v[0]}:store_rows].sm90", sass_instructions(sass))
    for tuning_name, tuning in aot.fused_act_tunings().items():
        for v in aot.fused_act_variants():
            _, sass = aot.sm90_resources(aot.compile_fused_act_variant(*v, tuning=tuning).asm["cubin"])
            tag = ",".join(aot.sig_type(x) if isinstance(x, torch.dtype) else str(x) for x in v)
            add(f"fused_act_gluon[{tag},{tuning_name}].sm90", sass_instructions(sass))
    return out


def renamed(fps: dict[str, str], renames: list[str]) -> dict[str, str]:
    """``fps`` with each ``OLD=NEW`` of ``renames`` applied to its names (substring replacement, in order)."""
    pairs = []
    for r in renames:
        old, sep, new = r.partition("=")
        if not sep or not old:
            raise ValueError(f"--rename takes OLD=NEW, got {r!r}")
        pairs.append((old, new))
    out = {}
    for name, fp in fps.items():
        for old, new in pairs:
            name = name.replace(old, new)
        out[name] = fp
    return out


def compare(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Lines describing every difference between two fingerprint sets (empty: the same code)."""
    lines = [f"changed  {name}" for name in sorted(old.keys() & new.keys()) if old[name] != new[name]]
    lines += [f"removed  {name}" for name in sorted(old.keys() - new.keys())]
    lines += [f"added    {name}" for name in sorted(new.keys() - old.keys())]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the fingerprints as JSON")
    ap.add_argument("--compare", type=Path, help="compare with fingerprints written earlier; exit 1 on any difference")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="with --compare: rename the earlier file's variants (substring OLD -> NEW) first")  # fmt: skip
    args = ap.parse_args(argv)
    fps = fingerprints(verbose=True)
    if args.out:
        args.out.write_text(json.dumps(fps, indent=1, sort_keys=True))
        print(f"wrote {len(fps)} fingerprints to {args.out}")
    if args.compare:
        diff = compare(renamed(json.loads(args.compare.read_text()), args.rename), fps)
        print("\n".join(diff) if diff else f"same code: all {len(fps)} variants")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
