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


def _golden_copy(golden_dir, tmp_path, **replace):
    """A copy of the TE goldens in tmp_path/g; ``replace[stem]`` = (tensors, metadata) to write as a plain
    ``<stem>.safetensors`` instead, or bytes to write as ``<stem>.safetensors.xz`` verbatim."""
    dst = tmp_path / "g"
    shutil.copytree(golden_dir, dst)
    for stem, new in replace.items():
        if isinstance(new, bytes):
            (dst / f"{stem}.safetensors.xz").write_bytes(new)
        else:
            (dst / f"{stem}.safetensors.xz").unlink()
            (dst / f"{stem}.safetensors").write_bytes(save(new[0], metadata=new[1] or None))
    return dst


def _edited(golden_dir, stem, fn):
    tensors, meta = _read(golden_dir, stem)
    fn(tensors, meta)
    return tensors, meta


def test_a_golden_set_without_cases_fails(golden_dir, tmp_path, capsys):
    empty = _golden_copy(golden_dir, tmp_path, quant=({}, {"te_version": "x"}), linear=({}, {}))
    assert main(["--golden", str(empty), "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    assert "yields no checks" in out and "checks passed" not in out


def test_a_golden_file_without_cases_is_named(golden_dir, tmp_path, capsys):
    # quantization still checked (and passing); the run says the linear layer was not
    only_quant = _golden_copy(golden_dir, tmp_path, linear=({}, {}))
    assert main(["--golden", str(only_quant), "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "all 30 checks passed" in out and f"note: {only_quant / 'linear.safetensors'} holds no cases" in out


def _drop(key):
    return lambda tensors, meta: tensors.pop(key)


@pytest.mark.parametrize(
    "stem, edit, message",
    [
        ("linear", _drop("cases/lin_272x384_640/wgrad"), "linear case 'lin_272x384_640' lacks ['wgrad']"),
        ("linear", _drop("cases/lin_272x384_640/bgrad"), "bias and bgrad go together (found only bias)"),
        ("linear", lambda t, m: t.update({"cases/lin_272x384_640/extra": t["cases/lin_272x384_640/x"].clone()}),
         "has unexpected keys ['extra']"),
        ("linear", lambda t, m: t.update({"cases/lin_272x384_640/dgrad": t["cases/lin_272x384_640/x"][:-1].clone()}),
         "dgrad has shape (271, 384), expected (272, 384)"),
        ("linear", lambda t, m: m.update({"cases/lin_272x384_640/fmt": "E3M4"}), "fmt='E3M4' is not E4M3 or HYBRID"),
        ("linear", lambda t, m: m.update({"cases/lin_272x384_640/snr_db_vs_fp32": "loud"}), "is not a number"),
        ("linear", lambda t, m: t.update({"lin_272x384_640/x": t["cases/lin_272x384_640/x"].clone()}),
         "unexpected key 'lin_272x384_640/x'"),
        ("quant", _drop("cases/ragged_200x320/dim1_pow20/columnwise_scale_inv"), "variant dim1_pow20: keys"),
        ("quant", lambda t, m: t.update({"cases/ragged_200x320/dim1_pow20/rowwise_scale_inv":
                                         t["cases/ragged_200x320/dim1_pow20/rowwise_scale_inv"][:, :-4].contiguous()}),
         "rowwise_scale_inv must be float32 of shape"),
        ("quant", _drop("cases/ragged_200x320/x"), "quant case 'ragged_200x320' has no input 'x'"),
        ("quant", lambda t, m: t.update({"cases/ragged_200x320/dim3_pow21/rowwise_data": t["cases/ragged_200x320/x"].clone()}),
         "unrecognised golden variant name 'dim3_pow21'"),
    ],
)  # fmt: skip
def test_a_malformed_golden_file_is_named_and_exits_2(golden_dir, tmp_path, capsys, stem, edit, message):
    bad = _golden_copy(golden_dir, tmp_path, **{stem: _edited(golden_dir, stem, edit)})
    assert main(["--golden", str(bad), "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert f"error: bad golden file {bad / (stem + '.safetensors')}: " in err and message in err, err


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: b"", "is empty (0 bytes)"),
        (lambda raw: raw[: len(raw) // 2], "is not complete xz data"),
        (lambda raw: lzma.compress(lzma.decompress(raw)[:5], preset=0), "is truncated (5 bytes"),
        (lambda raw: lzma.compress(lzma.decompress(raw)[:-1000], preset=0), "is truncated (its tensors need"),
        (lambda raw: lzma.compress(lzma.decompress(raw)[:100], preset=0), "is truncated (its header says"),
        (
            lambda raw: lzma.compress(b"\x02\x00\x00\x00\x00\x00\x00\x00{]" + b"\0" * 8, preset=0),
            "is not a valid safetensors file",
        ),
    ],
)
def test_an_unreadable_golden_file_is_named_and_exits_2(golden_dir, tmp_path, capsys, damage, message):
    raw = (golden_dir / "linear.safetensors.xz").read_bytes()
    bad = _golden_copy(golden_dir, tmp_path, linear=damage(raw))
    assert main(["--golden", str(bad), "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert f"error: bad golden file {bad / 'linear.safetensors.xz'}: {message}" in err, err


def test_a_golden_path_that_is_not_a_file_is_named(golden_dir, tmp_path, capsys):
    bad = _golden_copy(golden_dir, tmp_path)
    (bad / "quant.safetensors.xz").unlink()
    (bad / "quant.safetensors").mkdir()  # exists, cannot be read as a file
    assert main(["--golden", str(bad), "--backend", "reference"]) == 2
    assert f"error: bad golden file {bad / 'quant.safetensors'}: cannot read it" in capsys.readouterr().err
