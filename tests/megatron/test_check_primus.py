"""scripts/check_primus.py without Primus (CI has none; docs/INTEGRATION.md records a run on a Primus checkout):
what it says when a checkout is missing, and that its experiment files carry the documented override."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def check_primus(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import check_primus

    return check_primus


def test_a_missing_primus_checkout_is_said_plainly(check_primus, tmp_path, capsys):
    assert check_primus.main(["--primus", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "not a Primus checkout" in err and "not pip-installable" in err and "git clone --recursive" in err


def test_an_empty_megatron_submodule_is_said_plainly(check_primus, tmp_path, capsys):
    primus = tmp_path / "Primus"
    (primus / "primus" / "core" / "config").mkdir(parents=True)
    (primus / "primus" / "core" / "config" / "primus_config.py").write_text("")
    (primus / "third_party" / "Megatron-LM").mkdir(parents=True)  # a submodule never initialised
    assert check_primus.main(["--primus", str(primus)]) == 2
    assert "git -C" in (err := capsys.readouterr().err) and "submodule update --init third_party/Megatron-LM" in err
    assert check_primus.main(["--primus", str(primus), "--megatron", str(tmp_path / "other")]) == 2
    assert "no Megatron-LM there" in capsys.readouterr().err
    assert check_primus.main(["--primus", str(primus), "--models", "dense,bert"]) == 2


def test_the_documented_override_is_the_one_checked(check_primus):
    doc = (ROOT / "docs" / "INTEGRATION.md").read_text().split("\n## Primus\n", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)[1]
    documented = yaml.safe_load(block)["modules"]["pre_trainer"]["overrides"]
    assert documented == {**check_primus.OVERRIDES["dense"], **check_primus.OVERRIDES["common"]}
    assert documented["create_attention_mask_in_dataloader"] is False  # Primus's default is true: SDPA's masked kernel


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_experiment_files_hold_the_override_on_primus_presets(check_primus, tmp_path, kind):
    exp = yaml.safe_load(check_primus.experiment_yaml(kind, tmp_path))
    trainer = exp["modules"]["pre_trainer"]
    assert {"work_group", "user_name", "exp_name", "workspace"} <= exp.keys()  # what Primus's parser requires
    assert trainer["framework"] == "megatron" and trainer["model"] == check_primus.MODELS[kind][0]
    overrides = trainer["overrides"]
    for key, value in {**check_primus.OVERRIDES[kind], **check_primus.OVERRIDES["common"]}.items():
        assert overrides[key] == value, key
    assert overrides["spec"][1] == ("fp8_gpt_fast_moe_spec" if kind == "moe" else "fp8_gpt_fast_dense_spec")
    assert ("num_experts" in overrides) == (kind == "moe") and overrides["use_cpu_initialization"] is True
