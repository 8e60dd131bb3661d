"""The training entry as a Hydra application: --help, --cfg, -m sweeps, per-run output directories,
the config tree of an installed (non-editable) package, and the command line given to Hydra."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd, pythonpath=ROOT, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONPATH=str(pythonpath), OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"))
    cmd = [sys.executable, "-m", "primus_fp8_plugin.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")  # one tokenized corpus for the runs of this module


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_help_lists_the_groups_and_the_config(tmp_path):
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "primus_fp8_plugin.train: train a GPT" in out
    assert "fp8: bf16, blockwise, te_bf16, te_blockwise, te_spec_blockwise" in out
    assert "model: gpt_125m, llama3_8b, moe_small, tiny" in out
    assert "micro_batch_size: 8" in out  # the composed config
    assert not any(tmp_path.iterdir()), "--help wrote files"


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path):
    import yaml

    proc = cli("--cfg", "job", "fp8=bf16", "train.steps=7", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["fp8"]["mode"] == "bf16" and cfg["train"]["steps"] == 7 and cfg["model"]["name"] == "tiny"
    assert cfg["logging"]["dir"] == "${hydra:runtime.output_dir}"
    proc = cli("--cfg", "hydra", cwd=tmp_path)
    assert proc.returncode == 0 and "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}" in proc.stdout
    assert not any(tmp_path.iterdir()), "--cfg wrote files"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=fast", "train.lr"),
        ("fp8=nonsense", "Could not find 'fp8/nonsense'"),
        ("train.steps=-5", "train.steps: must be > 0"),
    ],
)
def test_bad_configuration_exits_2_also_under_cfg_and_multirun(tmp_path, override, message):
    for extra in ([], ["-m"]):
        proc = cli(*extra, override, "logging.progress=false", cwd=tmp_path)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert message in proc.stderr and "error: bad configuration" in proc.stderr
    if override != "train.steps=-5":  # values are checked when a run starts; types and groups at composition
        proc = cli("--cfg", "job", override, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr


def test_run_writes_into_its_own_output_directory(tmp_path, corpus):
    common = ["train.steps=2", "train.warmup_steps=1", "train.eval_interval=0", "logging.progress=false",
              "model.num_layers=1", f"data.cache_dir={corpus}"]  # fmt: skip
    proc = cli(*common, "fp8=bf16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")  # outputs/DATE/TIME
    assert {"metrics.jsonl", ".hydra", "train.log"} <= {p.name for p in run_dir.iterdir()}
    assert metrics(run_dir / "metrics.jsonl")[-1]["event"] == "end"
    assert str(run_dir / "metrics.jsonl") in proc.stdout
    # logging.dir=DIR: DIR is the run's output directory (metrics and Hydra's record together)
    proc = cli(*common, "fp8=bf16", "logging.dir=mine", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "mine" / "metrics.jsonl").is_file() and (tmp_path / "mine" / ".hydra" / "config.yaml").is_file()
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1


def test_multirun_sweep_runs_each_point_in_its_own_directory(tmp_path, corpus):
    proc = cli("-m", "fp8=bf16,blockwise", "train.steps=2", "train.warmup_steps=1", "train.eval_interval=0",
               "logging.progress=false", "model.num_layers=1", "backend=reference", f"data.cache_dir={corpus}",
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    modes = {}
    for job in ("0", "1"):
        records = metrics(sweep / job / "metrics.jsonl")
        start = next(r for r in records if r.get("event") == "start")
        steps = [r for r in records if "loss" in r and "event" not in r]
        assert [r["step"] for r in steps] == [1, 2] and records[-1]["event"] == "end"
        modes[job] = start["fp8"]
    assert modes == {"0": "bf16", "1": "blockwise"}
    assert (sweep / "multirun.yaml").is_file()


def test_hydra_command_line_of_each_process():
    from primus_fp8_plugin.train import hydra_args

    assert hydra_args(["fp8=bf16"], rank=0) == ["fp8=bf16"]
    assert hydra_args(["logging.dir=/x/y", "fp8=bf16"], rank=0) == ["logging.dir=/x/y", "fp8=bf16", "hydra.run.dir=/x/y"]
    assert hydra_args(["++logging.dir=a", "logging.dir=b"], rank=0)[-1] == "hydra.run.dir=b"  # the last one wins
    assert hydra_args(["logging.dir=a", "hydra.run.dir=c"], rank=0) == ["logging.dir=a", "hydra.run.dir=c"]
    assert hydra_args(["-m", "logging.dir=a", "fp8=bf16,blockwise"], rank=0) == ["-m", "fp8=bf16,blockwise", "hydra.sweep.dir=a"]
    rank1 = hydra_args(["fp8=bf16"], rank=1)
    assert rank1[0] == "fp8=bf16" and {"hydra.output_subdir=null", "hydra/job_logging=none", "hydra.run.dir=."} <= set(rank1)


def test_config_dir_lookup(tmp_path, monkeypatch):
    import primus_fp8_plugin.train as train

    # in a checkout: the package's configs/ (a link to the top-level configs/)
    assert train.CONFIG_DIR == Path(train.__file__).resolve().parent / "configs"
    assert (train.CONFIG_DIR / "config.yaml").samefile(ROOT / "configs" / "config.yaml")
    # a package directory without configs/ falls back to the checkout's configs/ next to it
    pkg = tmp_path / "primus_fp8_plugin"
    pkg.mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "config.yaml").write_text("defaults: []\n")
    monkeypatch.setattr(train, "__file__", str(pkg / "train.py"))
    assert train.find_config_dir() == tmp_path / "configs"
    (pkg / "configs").mkdir()
    (pkg / "configs" / "config.yaml").write_text("defaults: []\n")
    assert train.find_config_dir() == pkg / "configs"


def test_an_installed_wheel_carries_the_config_tree(tmp_path):
    """Build a wheel of this checkout (a copy, so the checkout gets no build/), install it into a
    directory outside the checkout and run its entry from there: the configs come from the wheel."""
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "primus_fp8_plugin", src / "primus_fp8_plugin", symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "configs", src / "configs")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("primus_fp8_plugin-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")}
    assert {f"primus_fp8_plugin/{n}" for n in shipped} <= names, sorted(shipped - {n[len("primus_fp8_plugin/") :] for n in names})
    assert "primus_fp8_plugin/py.typed" in names  # PEP 561: type checkers read the package's annotations
    assert any(".dist-info/" in n and n.endswith("LICENSE") for n in names), sorted(names)[-10:]
    site = tmp_path / "site"
    inst = subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert inst.returncode == 0, inst.stderr[-3000:]
    assert (site / "primus_fp8_plugin" / "configs" / "config.yaml").is_file()
    assert not (site / "primus_fp8_plugin" / "configs").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli("--cfg", "job", "fp8=bf16", "model=gpt_125m", cwd=elsewhere, pythonpath=site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mode: bf16" in proc.stdout and "hidden_size: 768" in proc.stdout
    where = subprocess.run([sys.executable, "-c", "import primus_fp8_plugin.train as t; print(t.CONFIG_DIR)"], cwd=elsewhere,
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)  # fmt: skip
    assert Path(where.stdout.strip()) == site / "primus_fp8_plugin" / "configs", where.stderr[-2000:]
