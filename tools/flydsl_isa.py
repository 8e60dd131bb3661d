"""Read a gfx950 AMDGCN listing (FlyDSL's ``*final_isa.s``): registers, LDS, spills, MFMA counts, the
instruction mix of the K loop and the occupancy the resources allow.

Occupancy (waves per SIMD) on CDNA3/CDNA4 (gfx942/gfx950), as this module computes it:

* registers: a SIMD lane has 512 unified VGPRs (architectural VGPRs and AGPRs); a wave allocates
  ``ceil8(ceil4(vgpr) + agpr)`` of them, so ``regs_waves = min(8, 512 // alloc)``;
* a workgroup of ``W`` waves puts ``ceil(W / 4)`` waves on each of the CU's 4 SIMDs, so registers allow
  ``regs_waves // ceil(W / 4)`` workgroups per CU, LDS ``LDS_PER_CU // lds_bytes`` (gfx950: 160 KiB);
* ``occupancy = min(8, ceil(W / 4) * min(regs workgroups, LDS workgroups))`` waves per SIMD.

(SGPRs, 800 per SIMD on gfx9, never bind for these kernels and are not counted.)

The K loop is the loop (a backward ``s_cbranch_*`` or ``s_branch`` to a label above it) holding the most MFMAs; its body
is counted once per trip: ``mfma`` (``v_mfma*``), ``valu`` (other ``v_*``, including
``v_accvgpr_*`` moves), ``vmem`` (``buffer_*``, ``global_*``, ``flat_*``), ``lds`` (``ds_*``),
``salu``/``smem`` (``s_*``).
"""

from __future__ import annotations

import re

LDS_PER_CU = 160 * 1024
VGPRS_PER_LANE = 512
MAX_WAVES_PER_SIMD = 8


def _meta(text: str, key: str) -> int:
    m = re.search(rf"^\s*-?\s*\.{key}:\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def _category(op: str) -> str:
    if op.startswith("v_mfma"):
        return "mfma"
    if op.startswith("v_"):
        return "valu"
    if op.startswith(("buffer_", "global_", "flat_")):
        return "vmem"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith("s_"):
        return "salu"
    return "other"


def loops(text: str) -> list[dict]:
    """Every loop of the listing: its label, trip body size and the instruction categories in it."""
    lines = text.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^(\.LBB\w+):", line)
        if m:
            labels[m.group(1)] = i
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^\s+s_(?:cbranch_\w+|branch)\s+(\.LBB\w+)", line)
        if not m or m.group(1) not in labels or labels[m.group(1)] >= i:
            continue
        body = []
        for x in lines[labels[m.group(1)] + 1 : i + 1]:
            s = x.strip()
            if not s or s.startswith((";", ".")) or x.startswith("."):
                continue
            body.append(s.split()[0])
        counts = {"mfma": 0, "valu": 0, "vmem": 0, "lds": 0, "salu": 0, "other": 0}
        for op in body:
            counts[_category(op)] += 1
        out.append({"label": m.group(1), "instructions": len(body), **counts})
    return out


def occupancy(vgpr: int, agpr: int, lds_bytes: int, waves_per_workgroup: int) -> int:
    """Waves per SIMD the registers and LDS allow (module docstring)."""
    alloc = -(-(-(-vgpr // 4) * 4 + agpr) // 8) * 8
    reg_waves = min(MAX_WAVES_PER_SIMD, VGPRS_PER_LANE // max(alloc, 1))
    per_simd = -(-waves_per_workgroup // 4)
    wg_regs = reg_waves // per_simd
    wg_lds = LDS_PER_CU // lds_bytes if lds_bytes else 10**6
    return min(MAX_WAVES_PER_SIMD, per_simd * min(wg_regs, wg_lds))


def isa_report(text: str, *, waves_per_workgroup: int, dynamic_lds_bytes: int = 0) -> dict:
    """The columns of the ISA comparison for one kernel listing (``text``)."""
    target = re.search(r'\.amdgcn_target\s+"([^"]+)"', text)
    mfma: dict[str, int] = {}
    for mnemonic in re.findall(r"^\s*(v_mfma\w*)", text, re.M):
        mfma[mnemonic] = mfma.get(mnemonic, 0) + 1
    vgpr, agpr = _meta(text, "vgpr_count"), _meta(text, "agpr_count")
    lds = _meta(text, "group_segment_fixed_size") + dynamic_lds_bytes
    all_loops = loops(text)
    k_loop = max(all_loops, key=lambda lp: lp["mfma"], default=None)
    per_iter = {key: (k_loop[key] if k_loop else 0) for key in ("mfma", "valu", "vmem", "lds", "salu")}
    return {
        "target": target.group(1) if target else "",
        "vgpr": vgpr,
        "agpr": agpr,
        "sgpr": _meta(text, "sgpr_count"),
        "vgpr_spills": _meta(text, "vgpr_spill_count"),
        "sgpr_spills": _meta(text, "sgpr_spill_count"),
        "lds_bytes": lds,
        "scratch_bytes": _meta(text, "private_segment_fixed_size"),
        "threads": 64 * waves_per_workgroup,
        "mfma": mfma,
        "mfma_total": sum(mfma.values()),
        "k_loop": per_iter,
        "valu_per_mfma": round(per_iter["valu"] / per_iter["mfma"], 2) if per_iter["mfma"] else None,
        "vmem_per_mfma": round(per_iter["vmem"] / per_iter["mfma"], 2) if per_iter["mfma"] else None,
        "occupancy": occupancy(vgpr, agpr, lds, waves_per_workgroup),
    }


COLUMNS = ("b_layout", "threads", "vgpr", "agpr", "lds_bytes", "spills", "mfma_total", "loop_mfma", "loop_valu",
           "loop_vmem", "loop_lds", "valu_per_mfma", "occupancy")  # fmt: skip


def row(name: str, r: dict) -> str:
    """One line of the side-by-side table."""
    kl = r["k_loop"]
    spills = r["vgpr_spills"] + r["scratch_bytes"]
    return (f"{name:34} {r.get('b_layout', '?'):12} {r['threads']:4} {r['vgpr']:4} {r['agpr']:4} {r['lds_bytes']:7} "
            f"{spills:6} {r['mfma_total']:5} {kl['mfma']:9} {kl['valu']:5} {kl['vmem']:5} {kl['lds']:5} "
            f"{r['valu_per_mfma']!s:>9} {r['occupancy']:3}")  # fmt: skip


def header() -> str:
    """Column names of ``row`` (``loop:*``: one trip of the K loop)."""
    return (f"{'kernel':34} {'b_layout':12} {'thr':>4} {'vgpr':>4} {'agpr':>4} {'lds':>7} {'spill':>6} {'mfma':>5} "
            f"{'loop:mfma':>9} {'valu':>5} {'vmem':>5} {'lds':>5} {'valu/mfma':>9} {'occ':>3}")  # fmt: skip
