#!/usr/bin/env python3
"""Summarise Nsight Compute reports written by ``tools/gpu/gpu_ncu.sh``: key metrics and where the warps stall.

    python -m tools.ncu OUTDIR/NAME [OUTDIR/NAME2 ...] [--top 8]

For each NAME: a few lines of ``NAME_details.txt`` (clock, duration, throughputs, the busiest pipe),
the warp-stall samples of ``NAME_sass.csv`` summed by reason over the kernel and by instruction kind
(FMUL, LDS, QGMMA, ...), and the instructions with the most samples (address, SASS, samples by reason).
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from pathlib import Path

DETAIL_KEYS = ("SM Frequency", "Duration", "DRAM Throughput", "L2 Cache Throughput", "Compute (SM) Throughput",
               "Issue Slots Busy", "Registers Per Thread", "Achieved Occupancy", "highest-utilized pipeline")  # fmt: skip


def details(path: Path) -> list[str]:
    if not path.exists():
        return [f"(no {path.name})"]
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if any(key in line for key in DETAIL_KEYS) and line.strip() not in out:
            out.append(re.sub(r"\s{2,}", " ", line.strip())[:120])
    return out


def instruction_kind(sass: str) -> str:
    """The mnemonic of a SASS line without predicate or modifiers (``@!P0 FMUL.FTZ R1, ...`` -> FMUL)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def by_kind(per_inst: list) -> dict[str, Counter]:
    """Stall samples summed over the instructions of each kind (rows as ``stalls`` collects them)."""
    kinds: dict[str, Counter] = {}
    for _, _, src, counts in per_inst:
        kinds.setdefault(instruction_kind(src.strip()), Counter()).update(counts)
    return kinds


def stalls(path: Path, top: int) -> list[str]:
    if not path.exists():
        return [f"(no {path.name})"]
    rows = list(csv.reader(path.read_text(errors="replace").splitlines()))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    reasons = [c for c in header if c.startswith("stall_") and "(Not Issued)" not in c]
    idx = {c: header.index(c) for c in reasons}
    total: Counter = Counter()
    per_inst = []
    for r in rows[header_at + 1 :]:
        if len(r) < len(header):
            continue
        counts = Counter()
        for c in reasons:
            try:
                counts[c] = int(float(r[idx[c]] or 0))
            except ValueError:
                pass
        total.update(counts)
        per_inst.append((sum(counts.values()), r[0], r[1], counts))
    n = sum(total.values()) or 1
    out = [f"total samples {n}"]
    out += [f"  {c:30} {v:8d} {100 * v / n:5.1f}%" for c, v in total.most_common() if v]
    out.append("by instruction kind (share of all samples; top reasons):")
    for kind, counts in sorted(by_kind(per_inst).items(), key=lambda t: -sum(t[1].values()))[:top]:
        why = " ".join(f"{c[6:]}:{100 * v / n:.1f}" for c, v in counts.most_common(3) if v)
        out.append(f"  {kind:10} {100 * sum(counts.values()) / n:5.1f}%  {why}")
    for s, addr, src, counts in sorted(per_inst, key=lambda t: -t[0])[:top]:
        why = " ".join(f"{c[6:]}:{v}" for c, v in counts.most_common(3) if v)
        out.append(f"  {s:6d} {100 * s / n:5.1f}% {addr[-5:]:>5} {src.strip()[:58]:58} {why}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="OUTDIR/NAME prefixes (as given to gpu_ncu.sh)")
    ap.add_argument("--top", type=int, default=8, help="instructions to list")
    args = ap.parse_args(argv)
    for prefix in args.reports:
        p = Path(prefix)
        print(f"== {p.name}")
        for line in details(p.parent / f"{p.name}_details.txt") + stalls(p.parent / f"{p.name}_sass.csv", args.top):
            print(" " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
