"""The validate CLI: passes on TE's goldens, fails (naming what) on tampered ones."""

import importlib.util
import lzma
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from primus_fp8_plugin.golden import _read, load_grouped_cases, load_quant_cases, parse_variant
from primus_fp8_plugin.recipe import BlockwiseRecipe
from primus_fp8_plugin.validate import main, run_linear


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
    assert f"{tmp_path} holds no golden file (quant.safetensors, linear.safetensors" in capsys.readouterr().err
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


# ---- grouped cases -------------------------------------------------------------------------------------------
# These goldens are made here, on the CPU, by the plugin's reference backend running its *dense* linear on each
# expert's tokens (not by TE, and not by the grouped op validate runs): the inputs are the ones
# scripts/make_te_goldens.py records TE's te.GroupedLinear on.

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("make_te_goldens", ROOT / "scripts" / "make_te_goldens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_loop_grouped_goldens(cases: dict) -> tuple[dict, dict]:
    tensors, meta = {}, {"source": "primus_fp8_plugin reference backend, dense linear per expert (CPU test data, not TE)"}
    for name, c in cases.items():
        recipe = BlockwiseRecipe(fp8_format=c["fmt"])
        counts = c["m_splits"].tolist()
        res = {"out": [], "dgrad": [], "wgrad": [], "bgrad": []}
        for e, (xe, dye) in enumerate(zip(torch.split(c["x"], counts), torch.split(c["grad_out"], counts))):
            r = run_linear(recipe, xe, c["weight"][e], c["bias"][e] if "bias" in c else None, dye, "reference")
            for key in res:
                if key in r:
                    res[key].append(r[key] if r[key] is not None else torch.zeros_like(c["weight"][e]))
        saved = {k: c[k] for k in ("x", "m_splits", "weight", "grad_out", "bias") if k in c}
        saved.update(out=torch.cat(res["out"]), dgrad=torch.cat(res["dgrad"]), wgrad=torch.stack(res["wgrad"]))
        if "bias" in c:
            saved["bgrad"] = torch.stack(res["bgrad"])
        tensors.update({f"cases/{name}/{k}": v.contiguous() for k, v in saved.items()})
        meta[f"cases/{name}/fmt"] = c["fmt"]
    return tensors, meta


@pytest.fixture(scope="module")
def grouped_goldens():
    cases = _script().grouped_inputs()
    return cases, dense_loop_grouped_goldens(cases)


def _with_grouped(golden_dir, tmp_path, tensors, meta, name="g"):
    dst = tmp_path / name
    shutil.copytree(golden_dir, dst)
    (dst / "grouped.safetensors").write_bytes(save(tensors, metadata=meta))
    return dst


def test_the_recorded_grouped_inputs_cover_the_edge_counts(grouped_goldens):
    cases, _ = grouped_goldens
    counts = {int(c) for case in cases.values() for c in case["m_splits"]}
    assert {0, 1, 15, 16, 127, 128, 129} <= counts
    assert any(len(set(c["m_splits"].tolist())) > 4 and len(c["m_splits"]) == 16 for c in cases.values())  # skewed
    assert {c["fmt"] for c in cases.values()} == {"E4M3", "HYBRID"}


def test_grouped_cases_pass_bit_for_bit_against_a_dense_loop(golden_dir, tmp_path, capsys, grouped_goldens):
    cases, (tensors, meta) = grouped_goldens
    d = _with_grouped(golden_dir, tmp_path, tensors, meta)
    loaded, _ = load_grouped_cases(d)
    assert [c.name for c in loaded] == sorted(cases)
    n_grouped = sum(4 + ("bias" in c) for c in cases.values())  # out, dgrad, wgrad, [bgrad], worst expert (no SNR)
    assert main(["--golden", str(d), "--backend", "reference", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("grouped")]
    assert len(rows) == n_grouped and f"all {40 + n_grouped} checks passed" in out
    assert all("bits equal" in line for line in rows if "worst" not in line), rows


def test_a_wrong_expert_gradient_fails_naming_the_expert(golden_dir, tmp_path, capsys, grouped_goldens):
    _, (tensors, meta) = grouped_goldens
    bad = dict(tensors)
    key = "cases/grp_edges_e8_256_384/wgrad"
    w = bad[key].clone()
    w[6] *= 1.01  # expert 6: 129 tokens
    bad[key] = w
    d = _with_grouped(golden_dir, tmp_path, bad, meta)
    assert main(["--golden", str(d), "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    assert "grouped grp_edges_e8_256_384 wgrad worst expert: expert 6 (129 tokens): rel. Frobenius error" in out


def test_grouped_snr_is_checked_where_recorded(golden_dir, tmp_path, capsys, grouped_goldens):
    _, (tensors, meta) = grouped_goldens
    d = _with_grouped(golden_dir, tmp_path, tensors, dict(meta, **{"cases/grp_skewed_e16_512_256/snr_db_vs_fp32": "99.0"}))
    assert main(["--golden", str(d), "--backend", "reference"]) == 1
    assert "grouped grp_skewed_e16_512_256 out SNR: " in capsys.readouterr().out


def test_a_directory_without_grouped_cases_says_so(golden_dir, capsys):
    assert main(["--golden", str(golden_dir), "--backend", "reference"]) == 0
    assert f"note: {golden_dir} has no grouped.safetensors: no grouped checks ran" in capsys.readouterr().out


def _set(key, value):
    return lambda t, m: t.update({key: value(t)})


G = "cases/grp_aligned16_e4_256_640"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, m: t.pop(f"{G}/m_splits"), "grouped case 'grp_aligned16_e4_256_640' lacks ['m_splits']"),
        (_set(f"{G}/m_splits", lambda t: t[f"{G}/m_splits"].float()), "m_splits must be a non-empty 1-D int32/int64"),
        (_set(f"{G}/m_splits", lambda t: t[f"{G}/m_splits"] + 1), "must be >= 0 and sum to x's 416 tokens (they sum to 420)"),
        (_set(f"{G}/wgrad", lambda t: t[f"{G}/wgrad"][:3].clone()), "wgrad has shape (3, 640, 256), expected (4, 640, 256)"),
        (_set(f"{G}/weight", lambda t: t[f"{G}/weight"][0].clone()), "do not fit [T, K] and [E, N, K]"),
        (lambda t, m: t.pop(f"{G}/bgrad"), "bias and bgrad go together (found only bias)"),
        (lambda t, m: m.update({f"{G}/fmt": "E5M2"}), "fmt='E5M2' is not E4M3 or HYBRID"),
    ],
)  # fmt: skip
def test_a_malformed_grouped_file_is_named_and_exits_2(golden_dir, tmp_path, capsys, grouped_goldens, edit, message):
    _, (tensors, meta) = grouped_goldens
    t, m = dict(tensors), dict(meta)
    edit(t, m)
    d = _with_grouped(golden_dir, tmp_path, t, m)
    assert main(["--golden", str(d), "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert f"error: bad golden file {d / 'grouped.safetensors'}: " in err and message in err, err


def test_pack_keeps_the_chosen_grouped_cases(golden_dir, tmp_path, grouped_goldens):
    from tools.pack_test_goldens import main as pack_main

    _, (tensors, meta) = grouped_goldens
    src = tmp_path / "src"
    src.mkdir()
    for stem in ("quant", "linear"):
        (src / f"{stem}.safetensors").write_bytes(lzma.decompress((golden_dir / f"{stem}.safetensors.xz").read_bytes()))
    (src / "grouped.safetensors").write_bytes(save(tensors, metadata=meta))
    pack_main(["--src", str(src), "--dst", str(tmp_path / "dst"), "--grouped-cases", "grp_aligned16_e4_256_640"])
    cases, packed_meta = load_grouped_cases(tmp_path / "dst")
    assert [c.name for c in cases] == ["grp_aligned16_e4_256_640"] and cases[0].counts == [0, 16, 144, 256]
    assert packed_meta["source"].startswith("primus_fp8_plugin reference backend")
    assert (tmp_path / "dst" / "linear.safetensors.xz").exists()
    pack_main(["--src", str(src), "--dst", str(tmp_path / "only"), "--only", "grouped"])
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["grouped.safetensors.xz"]
    assert [c.name for c in load_grouped_cases(tmp_path / "only")[0]] == sorted(_script().grouped_inputs())


class _FakeTE:
    """Stands for transformer_engine.pytorch in make_te_goldens.te_grouped_step on the CPU: its GroupedLinear is
    the plugin's (reference backend) and, like a TE that wants Megatron's padding, refuses counts that are not
    multiples of 16."""

    class GroupedLinear(torch.nn.Module):
        def __init__(self, num_gemms, in_features, out_features, bias, params_dtype, device):
            super().__init__()
            from primus_fp8_plugin import Fp8GroupedLinear

            self.inner = Fp8GroupedLinear(num_gemms, in_features, out_features, bias=bias, dtype=params_dtype,
                                          device=device, backend="reference", recipe=_FakeTE.recipe)  # fmt: skip
            for name, p in self.inner.named_parameters():
                self.register_parameter(name, p)

        def forward(self, x, m_splits):
            if any(int(c) % 16 for c in m_splits):
                raise RuntimeError("counts must be multiples of 16")
            return self.inner(x, list(m_splits))

    recipe = None

    @staticmethod
    def autocast(enabled, recipe):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("case", ["grp_edges_e8_384_256_hybrid", "grp_aligned16_e4_256_640"])
def test_the_recorder_pads_per_expert_where_te_refuses_and_drops_the_padding(grouped_goldens, case):
    """make_te_goldens.py's TE call on the CPU with a stand-in TE: the 16-padded run, its padding rows dropped,
    gives the dense loop's bits (zero rows change no scale and no product)."""
    script = _script()
    cases, (tensors, _) = grouped_goldens
    c = cases[case]
    _FakeTE.recipe = BlockwiseRecipe(fp8_format=c["fmt"])
    aligned = all(int(v) % 16 == 0 for v in c["m_splits"])
    if not aligned:
        with pytest.raises(RuntimeError, match="multiples of 16"):
            script.te_grouped_step(_FakeTE, None, c, "cpu")
    res = script.te_grouped_step(_FakeTE, None, c, "cpu", align=0 if aligned else 16)
    for key in ("out", "dgrad", "wgrad", "bgrad"):
        if key in res:
            want = tensors[f"cases/{case}/{key}"]
            assert torch.equal(res[key].to(want.dtype), want), key


def test_a_directory_with_grouped_cases_only_runs_them(tmp_path, capsys, grouped_goldens):
    _, (tensors, meta) = grouped_goldens
    d = tmp_path / "only_grouped"
    d.mkdir()
    (d / "grouped.safetensors").write_bytes(save(tensors, metadata=meta))
    assert main(["--golden", str(d), "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert f"note: {d} has no quant.safetensors: no quant checks ran" in out
    assert f"note: {d} has no linear.safetensors: no linear checks ran" in out and "checks passed" in out


TE_GROUPED = ROOT / "tests" / "data" / "te_golden_grouped"


@pytest.mark.skipif(not TE_GROUPED.is_dir(), reason="no TE grouped recording packed into tests/data/te_golden_grouped yet")
def test_passes_on_te_grouped_goldens(capsys):
    """TE's te.GroupedLinear recording (scripts/make_te_goldens.py, packed with ``--only grouped``)."""
    cases, meta = load_grouped_cases(TE_GROUPED)
    assert cases and "te_version" in meta
    expected = sum(4 + ("bias" in c.tensors) + (c.snr_db is not None) for c in cases)
    assert main(["--golden", str(TE_GROUPED), "--backend", "reference"]) == 0
    assert f"all {expected} checks passed" in capsys.readouterr().out
