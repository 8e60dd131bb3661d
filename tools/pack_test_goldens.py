#!/usr/bin/env python3
"""Copy a TE golden directory into tests/data as xz-compressed safetensors, optionally a subset.

    python -m tools.pack_test_goldens --src my_goldens --dst tests/data/te_golden \
        --linear-cases lin_272x384_640 lin_256x512_384_hybrid [--grouped-cases grp_edges_e8_256_384 ...]

``grouped.safetensors`` is packed where the source has one (all its cases unless ``--grouped-cases``);
``--only grouped`` packs it alone (TE's grouped recording goes to ``tests/data/te_golden_grouped``).

The test suite and ``python -m primus_fp8_plugin.validate`` read ``*.safetensors.xz`` directly.
"""

from __future__ import annotations

import argparse
import json
import lzma
import struct
from pathlib import Path

from safetensors.torch import load, save


def pack(src: Path, dst: Path, stem: str, keep_cases: list[str] | None) -> int:
    raw = (src / f"{stem}.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + hlen]).get("__metadata__", {}) or {}
    tensors = load(raw)
    if keep_cases:
        unknown = set(keep_cases) - {k.split("/")[1] for k in tensors}
        if unknown:
            raise SystemExit(f"{stem}: no such cases {sorted(unknown)}")
        tensors = {k: v for k, v in tensors.items() if k.split("/")[1] in keep_cases}
        meta = {k: v for k, v in meta.items() if not k.startswith("cases/") or k.split("/")[1] in keep_cases}
    blob = lzma.compress(save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta), preset=9)
    out = dst / f"{stem}.safetensors.xz"
    out.write_bytes(blob)
    return len(blob)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--dst", type=Path, required=True)
    ap.add_argument("--quant-cases", nargs="*", default=None, help="default: all")
    ap.add_argument("--linear-cases", nargs="*", default=None, help="default: all")
    ap.add_argument("--grouped-cases", nargs="*", default=None, help="default: all (where the source has grouped cases)")
    ap.add_argument("--only", choices=["all", "grouped"], default="all", help="'grouped': pack grouped.safetensors alone")
    args = ap.parse_args(argv)
    args.dst.mkdir(parents=True, exist_ok=True)
    total = 0
    if args.only == "all":
        total += pack(args.src, args.dst, "quant", args.quant_cases)
        total += pack(args.src, args.dst, "linear", args.linear_cases)
    if (args.src / "grouped.safetensors").exists():
        total += pack(args.src, args.dst, "grouped", args.grouped_cases)
    elif args.grouped_cases or args.only == "grouped":
        raise SystemExit(f"{args.src} has no grouped.safetensors")
    print(f"wrote {total / 2**20:.2f} MiB to {args.dst}")


if __name__ == "__main__":
    main()
