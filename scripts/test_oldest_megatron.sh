#!/usr/bin/env bash
# The plugin against the oldest supported megatron-core (0.16.1, what `pip install ".[megatron]"` gives on
# Python 3.10/3.11): sets up a second virtualenv ($VENV_OLDEST, default .venv-megatron-0.16) the way a user
# installs, then runs the tests that build the dense and MoE specs, train them a step on the CPU and run
# check_spec. scripts/test.sh calls it after the main suite; extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_OLDEST="0.16.1"  # = the floor in pyproject.toml
VENV_OLDEST="${VENV_OLDEST:-$ROOT/.venv-megatron-0.16}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"  # CPU build; lies on disk on our CI machines

stamp="$VENV_OLDEST/.primus-fp8-setup"
want="$(cat pyproject.toml scripts/test_oldest_megatron.sh | sha256sum | cut -d' ' -f1)"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  echo "[oldest] creating virtualenv $VENV_OLDEST (megatron-core $MEGATRON_OLDEST)"
  "$PYTHON" -m venv --clear "$VENV_OLDEST"
  "$VENV_OLDEST/bin/python" -m pip install -q --upgrade pip
  "$VENV_OLDEST/bin/python" -m pip install -q "$TORCH_SPEC"
  # the user's install, with megatron-core held at the floor; pytest for the tests (no Triton: reference backend)
  "$VENV_OLDEST/bin/python" -m pip install -q -e ".[megatron]" "megatron-core==$MEGATRON_OLDEST" "pytest>=8"
  echo "$want" > "$stamp"
fi

# dense and MoE specs (unfused, fast, grouped and sequential experts) built, one forward/backward each, a
# distributed checkpoint moved between expert kinds, check_spec in-process and as `python -m`
TESTS=(
  tests/megatron/test_versions.py
  "tests/megatron/test_gpt_cpu.py::test_fp8_gpt_agrees_with_bf16_within_fp8_tolerance"
  "tests/megatron/test_gpt_cpu.py::test_rmsnorm_and_moe_specs_run"
  "tests/megatron/test_moe_grouped.py::test_specs_put_the_grouped_experts_where_te_grouped_mlp_stands"
  "tests/megatron/test_moe_grouped.py::test_grouped_experts_equal_sequential_experts_and_share_their_checkpoints"
  "tests/megatron/test_main_grad_fusion.py::test_the_layers_fill_main_grad_with_the_flag_off_and_the_hook_adds_nothing"
  "tests/megatron/test_moe_routed.py::test_routed_layer_equals_megatrons_dispatcher_bit_for_bit"
  "tests/megatron/test_fast_spec.py::test_object_exports_build_for_both_norms"
  "tests/megatron/test_fast_spec.py::test_fast_spec_equals_the_unfused_plugin_spec_bit_for_bit[reference-cfg_kw0-True]"
  "tests/megatron/test_fast_spec.py::test_check_spec_cli"
  "tests/megatron/test_fast_spec.py::test_check_spec_runs_as_a_module"
)
echo "[oldest] pytest against megatron-core $("$VENV_OLDEST/bin/python" -W ignore -c 'import megatron.core as m; print(m.__version__)')"
set +e
"$VENV_OLDEST/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[oldest] pytest collected no tests: that proves nothing, so it counts as a failure" >&2
  exit 1
fi
exit "$rc"
