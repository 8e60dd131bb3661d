"""The validate CLI: passes on TE's goldens, fails (naming what) on tampered ones."""

import lzma
import shutil

import pytest
from safetensors.torch import load, save

from primus_fp8_plugin.golden import _read, load_quant_cases, parse_variant
from primus_fp8_plugin.validate import main


def test_passes_on_te_goldens(golden_dir, capsys, tmp_path):
    assert main(["--golden", str(golden_dir), "--backend", "reference", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "all 40 checks passed" in out and "FAIL" not in out
    assert (tmp_path / "r.json").read_text().count('"passed": true') == 40


def _tamper(golden_dir, tmp_path, stem, key, fn):
    dst = tmp_path / "golden"
    shutil.copytree(golden_dir, dst)
    tensors, meta = _read(dst, stem)
    tensors[key] = fn(tensors[key].clone())
    (dst / f"{stem}.safetensors.xz").write_bytes(lzma.compress(save(tensors, metadata=meta), preset=0))
    return dst


def test_one_flipped_fp8_byte_fails(golden_dir, tmp_path, capsys):
    def flip(t):
        t[3, 5] ^= 1
        return t

    bad = _tamper(golden_dir, tmp_path, "quant", "cases/ragged_200x320/dim1_pow20/columnwise_data", flip)
    assert main(["--golden", str(bad), "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAILED 1 of 40" in out
        and "quant ragged_200x320 dim1_pow20: row: data 0/64000 differ, scales 0/600; col: data 1/64000" in out
    )


def test_wrong_linear_output_fails(golden_dir, tmp_path, capsys):
    bad = _tamper(golden_dir, tmp_path, "linear", "cases/lin_272x384_640/wgrad", lambda t: t * 1.01)
    assert main(["--golden", str(bad), "--backend", "reference"]) == 1
    assert "linear lin_272x384_640 wgrad: rel. Frobenius error" in capsys.readouterr().out


def test_usage_errors(tmp_path, capsys):
    assert main(["--golden", str(tmp_path / "nope")]) == 2
    assert main(["--golden", str(tmp_path)]) == 2
    assert "neither quant.safetensors nor quant.safetensors.xz" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unrecognised golden variant"):
        parse_variant("dim3_pow21")


def test_plain_and_compressed_goldens_read_the_same(golden_dir, tmp_path):
    raw = lzma.decompress((golden_dir / "quant.safetensors.xz").read_bytes())
    (tmp_path / "quant.safetensors").write_bytes(raw)
    a, _ = load_quant_cases(tmp_path)
    b, _ = load_quant_cases(golden_dir)
    assert [c.name for c in a] == [c.name for c in b] and len(load(raw)) > 0
