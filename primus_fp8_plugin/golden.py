"""Reading directories of Transformer Engine golden outputs (format: ``docs/GOLDENS.md``).

A directory holds ``quant.safetensors``, ``linear.safetensors`` and optionally ``grouped.safetensors``
(each may instead be stored xz-compressed as ``*.safetensors.xz``). Keys are paths ``cases/<case>/...``; string facts sit in
the file's metadata. A file that cannot be read, is not safetensors (empty, truncated, not xz) or
does not hold the documented keys, dtypes and shapes raises ``GoldenFormatError`` naming the file.
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

from .tensor import BlockwiseFp8Tensor

_VARIANT = re.compile(r"^dim(?P<dim>[12])_pow2(?P<pow2>[01])(?P<e5m2>_e5m2)?$")
QUANT_VARIANT_KEYS = frozenset({"rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"})
LINEAR_KEYS = frozenset({"x", "weight", "grad_out", "out", "dgrad", "wgrad"})
LINEAR_OPTIONAL_KEYS = frozenset({"bias", "bgrad"})
GROUPED_KEYS = frozenset({"x", "m_splits", "weight", "grad_out", "out", "dgrad", "wgrad"})
GROUPED_OPTIONAL_KEYS = LINEAR_OPTIONAL_KEYS
_COUNT_DTYPES = (torch.int32, torch.int64)
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


class GoldenFormatError(ValueError):
    """A golden file that cannot be read or breaks the format of ``docs/GOLDENS.md``; the message
    starts with the file's path."""

    def __init__(self, path: Path, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


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


@dataclass
class GroupedCase:
    """A grouped (mixture-of-experts) linear case: ``E`` experts' ``y_e = x_e W_e^T + b_e`` on permuted tokens."""

    name: str
    fmt: str
    tensors: dict[str, torch.Tensor]
    counts: list[int]
    snr_db: float | None
    pow2_scales: bool


def parse_variant(name: str) -> tuple[int, bool, torch.dtype]:
    """``dim1_pow21_e5m2`` -> (block_dim 1, pow2 True, float8_e5m2)."""
    m = _VARIANT.match(name)
    if not m:
        raise ValueError(f"unrecognised golden variant name {name!r} (expected dim<1|2>_pow2<0|1>[_e5m2])")
    dtype = torch.float8_e5m2 if m["e5m2"] else torch.float8_e4m3fn
    return int(m["dim"]), m["pow2"] == "1", dtype


def golden_file(path_dir: Path, stem: str) -> Path:
    """``<stem>.safetensors`` in ``path_dir``, else ``<stem>.safetensors.xz``; FileNotFoundError if neither."""
    plain, packed = path_dir / f"{stem}.safetensors", path_dir / f"{stem}.safetensors.xz"
    if plain.exists():
        return plain
    if packed.exists():
        return packed
    raise FileNotFoundError(f"{path_dir} has neither {plain.name} nor {packed.name}")


def optional_golden_file(path_dir: Path, stem: str) -> Path | None:
    """``golden_file`` for a file a golden directory may leave out: None where neither form exists."""
    try:
        return golden_file(path_dir, stem)
    except FileNotFoundError:
        return None


def _read(path_dir: Path, stem: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta, _ = _read_file(golden_file(path_dir, stem))
    return tensors, meta


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], Path]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise GoldenFormatError(path, f"cannot read it ({err.strerror or err})") from None
    if not raw:
        raise GoldenFormatError(path, "is empty (0 bytes)")
    if path.suffix == ".xz":
        try:
            raw = lzma.decompress(raw)
        except lzma.LZMAError as err:
            raise GoldenFormatError(path, f"is not complete xz data ({err}); the file is truncated or damaged") from None
    # safetensors: an 8-byte little-endian header length, a JSON header, then the tensor bytes
    if len(raw) < 8:
        raise GoldenFormatError(path, f"is truncated ({len(raw)} bytes, not even a safetensors header)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > len(raw) - 8:
        raise GoldenFormatError(path, f"is truncated (its header says {header_len} bytes, {len(raw) - 8} follow)")
    try:
        header = json.loads(raw[8 : 8 + header_len])
        meta = header.get("__metadata__", {}) or {}
        need = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"] + [0])
        if need > len(raw) - 8 - header_len:
            raise GoldenFormatError(
                path, f"is truncated (its tensors need {need} bytes, {len(raw) - 8 - header_len} follow the header)"
            )
        tensors = st_load(raw)
    except GoldenFormatError:
        raise
    except Exception as err:  # noqa: BLE001 - JSON, UTF-8 and safetensors' own (Rust) errors alike
        raise GoldenFormatError(path, f"is not a valid safetensors file ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise GoldenFormatError(path, "has metadata that is not a string-to-string map")
    return tensors, meta, path


def _group(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, dict[str, torch.Tensor]]:
    cases: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != "cases" or not all(parts):
            raise GoldenFormatError(path, f"unexpected key {key!r} (expected cases/<case>/...)")
        cases.setdefault(parts[1], {})["/".join(parts[2:])] = t
    return cases


def _flag(meta: dict[str, str], key: str, default: str, path: Path) -> bool:
    value = meta.get(key, default)
    if value not in ("1", "0", "true", "false", "True", "False"):
        raise GoldenFormatError(path, f"metadata {key}={value!r} is not 1 or 0")
    return value in ("1", "true", "True")


def load_quant_cases(golden_dir: str | Path) -> tuple[list[QuantCase], dict[str, str]]:
    """The quantization cases of ``golden_dir`` (``quant.safetensors[.xz]``), each checked: a 2-D
    high-precision ``x``, at least one variant, each variant's four TE buffers with the dtypes and
    shapes of ``docs/GOLDENS.md``. GoldenFormatError naming the file otherwise."""
    tensors, meta, path = _read_file(golden_file(Path(golden_dir), "quant"))
    out = []
    for case, items in sorted(_group(tensors, path).items()):
        where = f"quant case {case!r}"
        x = items.get("x")
        if x is None:
            raise GoldenFormatError(path, f"{where} has no input 'x'")
        if x.dim() != 2 or x.dtype not in _HIGH_PRECISION:
            raise GoldenFormatError(path, f"{where}: x must be a 2-D bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
        stray = sorted(k for k in items if k != "x" and "/" not in k)
        if stray:
            raise GoldenFormatError(path, f"{where} has unexpected keys {stray}")
        qc = QuantCase(case, x)
        for name in sorted({k.split("/")[0] for k in items if "/" in k}):
            try:
                dim, pow2, dtype = parse_variant(name)
            except ValueError as err:
                raise GoldenFormatError(path, f"{where}: {err}") from None
            sub = {k.split("/", 1)[1]: v for k, v in items.items() if k.startswith(name + "/")}
            if sub.keys() != QUANT_VARIANT_KEYS:
                got = sorted(sub)
                raise GoldenFormatError(path, f"{where} variant {name}: keys {got}, expected {sorted(QUANT_VARIANT_KEYS)}")
            try:
                BlockwiseFp8Tensor.from_te(shape=tuple(x.shape), block_dim=dim, fp8_dtype=dtype, orig_dtype=x.dtype, **sub)
            except (ValueError, RuntimeError, TypeError) as err:
                raise GoldenFormatError(path, f"{where} variant {name}: {err}") from None
            qc.variants.append(QuantVariant(name, dim, pow2, dtype, sub))
        if not qc.variants:
            raise GoldenFormatError(path, f"{where} has no variants (dim<1|2>_pow2<0|1>[_e5m2]/...)")
        out.append(qc)
    return out, meta


def load_linear_cases(golden_dir: str | Path) -> tuple[list[LinearCase], dict[str, str]]:
    """The linear cases of ``golden_dir`` (``linear.safetensors[.xz]``), each checked: the keys of
    ``docs/GOLDENS.md`` (``bias`` and ``bgrad`` together or not at all), floating dtypes, shapes that
    fit ``y = x W^T + b`` and the metadata values. GoldenFormatError naming the file otherwise."""
    tensors, meta, path = _read_file(golden_file(Path(golden_dir), "linear"))
    out = []
    for case, items in sorted(_group(tensors, path).items()):
        where = f"linear case {case!r}"
        missing = LINEAR_KEYS - items.keys()
        if missing:
            raise GoldenFormatError(path, f"{where} lacks {sorted(missing)}")
        stray = items.keys() - LINEAR_KEYS - LINEAR_OPTIONAL_KEYS
        if stray:
            raise GoldenFormatError(path, f"{where} has unexpected keys {sorted(stray)}")
        if ("bias" in items) != ("bgrad" in items):
            raise GoldenFormatError(
                path, f"{where}: bias and bgrad go together (found only {'bias' if 'bias' in items else 'bgrad'})"
            )
        _check_linear_shapes(items, path, where)
        fmt, snr_db, pow2 = _case_meta(meta, case, path)
        out.append(LinearCase(name=case, fmt=fmt, tensors=items, snr_db=snr_db, pow2_scales=pow2))
    return out, meta


def _check_linear_shapes(t: dict[str, torch.Tensor], path: Path, where: str) -> None:
    for name, v in t.items():
        if v.dtype not in _HIGH_PRECISION:
            raise GoldenFormatError(path, f"{where}: {name} has dtype {v.dtype}, expected bf16, fp16 or fp32")
    w, x = t["weight"], t["x"]
    if w.dim() != 2 or x.dim() < 2 or x.shape[-1] != w.shape[1]:
        raise GoldenFormatError(path, f"{where}: x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit [..., K] and [N, K]")
    y = (*x.shape[:-1], w.shape[0])
    want = {
        "out": y,
        "grad_out": y,
        "dgrad": tuple(x.shape),
        "wgrad": tuple(w.shape),
        "bias": (w.shape[0],),
        "bgrad": (w.shape[0],),
    }
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != tuple(shape):
            raise GoldenFormatError(path, f"{where}: {name} has shape {tuple(t[name].shape)}, expected {tuple(shape)}")


def _case_meta(meta: dict[str, str], case: str, path: Path) -> tuple[str, float | None, bool]:
    fmt = meta.get(f"cases/{case}/fmt", "E4M3")
    if fmt not in ("E4M3", "HYBRID"):
        raise GoldenFormatError(path, f"metadata cases/{case}/fmt={fmt!r} is not E4M3 or HYBRID")
    snr = meta.get(f"cases/{case}/snr_db_vs_fp32")
    try:
        snr_db = None if snr is None else float(snr)
    except ValueError:
        raise GoldenFormatError(path, f"metadata cases/{case}/snr_db_vs_fp32={snr!r} is not a number") from None
    return fmt, snr_db, _flag(meta, f"cases/{case}/pow2_scales", meta.get("pow2_scales", "1"), path)


def load_grouped_cases(golden_dir: str | Path) -> tuple[list[GroupedCase], dict[str, str]]:
    """The grouped-linear cases of ``golden_dir`` (``grouped.safetensors[.xz]``; none, with empty metadata,
    where the directory has no such file), each checked: the keys of ``docs/GOLDENS.md`` (``bias`` and
    ``bgrad`` together or not at all), an integer ``m_splits [E]`` of counts >= 0 summing to the tokens,
    floating tensors with the shapes of ``E`` linears ``[N, K]``, and the metadata values. GoldenFormatError
    naming the file otherwise."""
    file = optional_golden_file(Path(golden_dir), "grouped")
    if file is None:
        return [], {}
    tensors, meta, path = _read_file(file)
    out = []
    for case, items in sorted(_group(tensors, path).items()):
        where = f"grouped case {case!r}"
        missing = GROUPED_KEYS - items.keys()
        if missing:
            raise GoldenFormatError(path, f"{where} lacks {sorted(missing)}")
        stray = items.keys() - GROUPED_KEYS - GROUPED_OPTIONAL_KEYS
        if stray:
            raise GoldenFormatError(path, f"{where} has unexpected keys {sorted(stray)}")
        if ("bias" in items) != ("bgrad" in items):
            raise GoldenFormatError(
                path, f"{where}: bias and bgrad go together (found only {'bias' if 'bias' in items else 'bgrad'})"
            )
        counts = _check_grouped_shapes(items, path, where)
        fmt, snr_db, pow2 = _case_meta(meta, case, path)
        out.append(GroupedCase(name=case, fmt=fmt, tensors=items, counts=counts, snr_db=snr_db, pow2_scales=pow2))
    return out, meta


def _check_grouped_shapes(t: dict[str, torch.Tensor], path: Path, where: str) -> list[int]:
    m = t["m_splits"]
    if m.dtype not in _COUNT_DTYPES or m.dim() != 1 or m.numel() == 0:
        raise GoldenFormatError(path, f"{where}: m_splits must be a non-empty 1-D int32/int64 tensor, got {m.dtype} "
                                      f"{tuple(m.shape)}")  # fmt: skip
    counts = [int(c) for c in m.tolist()]
    for name, v in t.items():
        if name != "m_splits" and v.dtype not in _HIGH_PRECISION:
            raise GoldenFormatError(path, f"{where}: {name} has dtype {v.dtype}, expected bf16, fp16 or fp32")
    w, x = t["weight"], t["x"]
    if w.dim() != 3 or w.shape[0] != len(counts) or x.dim() != 2 or x.shape[1] != w.shape[2]:
        raise GoldenFormatError(path, f"{where}: x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit [T, K] and "
                                      f"[E, N, K] with E = {len(counts)} experts (m_splits)")  # fmt: skip
    if min(counts) < 0 or sum(counts) != x.shape[0]:
        raise GoldenFormatError(path, f"{where}: m_splits {counts[:8]}{'...' if len(counts) > 8 else ''} must be >= 0 "
                                      f"and sum to x's {x.shape[0]} tokens (they sum to {sum(counts)})")  # fmt: skip
    e, n, k = w.shape
    want = {"out": (x.shape[0], n), "grad_out": (x.shape[0], n), "dgrad": tuple(x.shape), "wgrad": (e, n, k),
            "bias": (e, n), "bgrad": (e, n)}  # fmt: skip
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != tuple(shape):
            raise GoldenFormatError(path, f"{where}: {name} has shape {tuple(t[name].shape)}, expected {tuple(shape)}")
    return counts
