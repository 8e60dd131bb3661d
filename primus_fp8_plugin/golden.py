"""Reading directories of Transformer Engine golden outputs (format: ``docs/GOLDENS.md``).

A directory holds ``quant.safetensors`` and ``linear.safetensors`` (each may instead be stored
xz-compressed as ``*.safetensors.xz``). Keys are paths ``cases/<case>/...``; string facts sit in
the file's metadata.
"""

from __future__ import annotations

import json
import lzma
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load

_VARIANT = re.compile(r"^dim(?P<dim>[12])_pow2(?P<pow2>[01])(?P<e5m2>_e5m2)?$")


@dataclass
class QuantVariant:
    name: str
    block_dim: int
    pow2_scales: bool
    fp8_dtype: torch.dtype
    tensors: dict[str, torch.Tensor]


@dataclass
class QuantCase:
    name: str
    x: torch.Tensor
    variants: list[QuantVariant] = field(default_factory=list)


@dataclass
class LinearCase:
    name: str
    fmt: str
    tensors: dict[str, torch.Tensor]
    snr_db: float | None
    pow2_scales: bool


def parse_variant(name: str) -> tuple[int, bool, torch.dtype]:
    """``dim1_pow21_e5m2`` -> (block_dim 1, pow2 True, float8_e5m2)."""
    m = _VARIANT.match(name)
    if not m:
        raise ValueError(f"unrecognised golden variant name {name!r} (expected dim<1|2>_pow2<0|1>[_e5m2])")
    dtype = torch.float8_e5m2 if m["e5m2"] else torch.float8_e4m3fn
    return int(m["dim"]), m["pow2"] == "1", dtype


def _read(path_dir: Path, stem: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    plain, packed = path_dir / f"{stem}.safetensors", path_dir / f"{stem}.safetensors.xz"
    if plain.exists():
        raw = plain.read_bytes()
    elif packed.exists():
        raw = lzma.decompress(packed.read_bytes())
    else:
        raise FileNotFoundError(f"{path_dir} has neither {plain.name} nor {packed.name}")
    tensors = st_load(raw)
    # safetensors.torch.load drops metadata; read the JSON header directly.
    (header_len,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__", {}) or {}
    return tensors, meta


def _group(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    cases: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != "cases":
            raise ValueError(f"unexpected key {key!r} in golden file (expected cases/<case>/...)")
        cases.setdefault(parts[1], {})["/".join(parts[2:])] = t
    return cases


def load_quant_cases(golden_dir: str | Path) -> tuple[list[QuantCase], dict[str, str]]:
    tensors, meta = _read(Path(golden_dir), "quant")
    out = []
    for case, items in sorted(_group(tensors).items()):
        if "x" not in items:
            raise ValueError(f"quant case {case!r} has no input 'x'")
        qc = QuantCase(case, items["x"])
        names = sorted({k.split("/")[0] for k in items if "/" in k})
        for name in names:
            dim, pow2, dtype = parse_variant(name)
            sub = {k.split("/", 1)[1]: v for k, v in items.items() if k.startswith(name + "/")}
            qc.variants.append(QuantVariant(name, dim, pow2, dtype, sub))
        out.append(qc)
    return out, meta


def load_linear_cases(golden_dir: str | Path) -> tuple[list[LinearCase], dict[str, str]]:
    tensors, meta = _read(Path(golden_dir), "linear")
    out = []
    for case, items in sorted(_group(tensors).items()):
        missing = {"x", "weight", "grad_out", "out", "dgrad", "wgrad"} - items.keys()
        if missing:
            raise ValueError(f"linear case {case!r} lacks {sorted(missing)}")
        snr = meta.get(f"cases/{case}/snr_db_vs_fp32")
        pow2 = meta.get(f"cases/{case}/pow2_scales", meta.get("pow2_scales", "1"))
        out.append(
            LinearCase(
                name=case,
                fmt=meta.get(f"cases/{case}/fmt", "E4M3"),
                tensors=items,
                snr_db=None if snr is None else float(snr),
                pow2_scales=pow2 in ("1", "true", "True"),
            )
        )
    return out, meta
