"""The supported megatron-core versions (compat.py): what an absent or too old Megatron says, and the experts
entry an older ``MoELayer`` builds. The same tests run against the oldest supported megatron-core (0.16.1) in
CI's second environment (scripts/test_oldest_megatron.sh) and against the main one (0.19.2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .common import build_gpt, loss_and_grads, submodules_of, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def run_with_megatron(tmp_path: Path, megatron_init: str, core_init: str | None, *args: str):
    """Run Python (``args``) with a stand-in ``megatron`` package first on the path: ``megatron/__init__.py``
    holding ``megatron_init`` and, with ``core_init``, ``megatron/core/__init__.py`` holding that."""
    pkg = tmp_path / "megatron"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(megatron_init)
    if core_init is not None:
        (pkg / "core").mkdir()
        (pkg / "core" / "__init__.py").write_text(core_init)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run([sys.executable, "-W", "ignore", *args], env=env, capture_output=True, text=True, timeout=300)


CHECK_SPEC = ("-m", "primus_fp8_plugin.megatron.check_spec", "primus_fp8_plugin.megatron", "fp8_gpt_layer_spec")


@pytest.mark.parametrize(
    "megatron_init, core_init, said",
    [
        ("", "__version__ = '0.15.3'\n", "does not support megatron-core 0.15.3"),
        ("raise ImportError('no megatron here')\n", None, "needs megatron-core, which does not import here"),
    ],
    ids=["too_old", "absent"],
)
def test_check_spec_says_in_one_line_what_megatron_lacks(tmp_path, megatron_init, core_init, said):
    run = run_with_megatron(tmp_path, megatron_init, core_init, *CHECK_SPEC)
    assert run.returncode == 2, run.stderr
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("check_spec: FAILED ") and said in run.stderr
    assert "supported: megatron-core 0.16.1 to 0.19.x" in run.stderr and "pip install" in run.stderr


def test_the_plugins_names_raise_what_megatron_lacks(tmp_path):
    """The package imports (check_spec needs it to) and its names raise the version error."""
    code = """
import primus_fp8_plugin.megatron as m
assert isinstance(m.import_error, ImportError), m.import_error
try:
    from primus_fp8_plugin.megatron import get_gpt_layer_spec
except ImportError as err:
    print(type(err).__name__, err)
"""
    run = run_with_megatron(tmp_path, "", "__version__ = '0.15.3'\n", "-c", code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("MegatronVersionError ") and "megatron-core 0.15.3" in run.stdout


def test_an_unexpected_import_error_names_the_installed_version():
    from megatron.core import __version__

    from primus_fp8_plugin.megatron.compat import SUPPORTED, MegatronVersionError, explain_import_error

    err = explain_import_error(ImportError("cannot import name 'Gone' from 'megatron.core.x'"))
    assert isinstance(err, MegatronVersionError)
    assert f"megatron-core {__version__}" in str(err) and "'Gone'" in str(err) and SUPPORTED in str(err)
    assert explain_import_error(err) is err


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("grouped", [True, False])
def test_experts_reach_any_moe_layer_as_megatrons_own_modules(grouped):
    """``compat.moe_experts`` hands a builder to this Megatron's ``MoELayer`` in the form it builds (a builder from
    0.17 on, a ``ModuleSpec`` before): the experts are Megatron's own modules holding the plugin's linears (no
    wrapper in between, so checkpoint keys stay Megatron's), and the layer trains."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from primus_fp8_plugin.megatron import Fp8Experts, Fp8GroupedMLP, fp8_gpt_moe_layer_spec, is_fp8_linear
    from primus_fp8_plugin.megatron.compat import EXPERTS_ARE_BUILDERS, ExpertsFromBuilder

    experts_entry = submodules_of(fp8_gpt_moe_layer_spec.submodules.mlp).experts
    if EXPERTS_ARE_BUILDERS:
        assert isinstance(experts_entry, Fp8Experts)
    else:
        assert experts_entry.module is ExpertsFromBuilder and isinstance(experts_entry.params["builder"], Fp8Experts)
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather", add_bias_linear=False,
                         moe_grouped_gemm=grouped, moe_ffn_hidden_size=256)  # fmt: skip
    model = build_gpt(fp8_gpt_moe_layer_spec, config)
    experts = model.module.decoder.layers[0].mlp.experts
    # grouped: Megatron's TEGroupedMLP (its parameters and checkpoint keys) with SwiGLU fused into fc2
    assert type(experts) is (Fp8GroupedMLP if grouped else SequentialMLP)
    assert isinstance(experts, TEGroupedMLP) or not grouped
    assert sum(is_fp8_linear(m) for m in experts.modules()) == (2 if grouped else 8)
    assert any(".mlp.experts.linear_fc1.weight" in k or ".mlp.experts.local_experts.0.linear_fc1.weight" in k
               for k in model.state_dict())  # fmt: skip
    loss, grads = loss_and_grads(model)
    assert torch.isfinite(torch.tensor(loss))
    expert_grads = [g for n, g in grads.items() if ".experts." in n]
    assert expert_grads and all(torch.isfinite(g).all() for g in expert_grads) and any(g.abs().sum() > 0 for g in expert_grads)


def test_megatrons_legacy_grouped_mlp_is_refused_by_name():
    """megatron-core 0.16 asks a spec provider for its legacy GroupedMLP too; the plugin has no FP8 one."""
    from primus_fp8_plugin.megatron import Fp8SpecProvider

    with pytest.raises(NotImplementedError, match="--moe-use-legacy-grouped-gemm"):
        Fp8SpecProvider().grouped_mlp_modules(True, True)
