"""benchmarks/megatron_lm.py on the CPU: log parsing, the summary's arithmetic, the spec check."""

from __future__ import annotations

import importlib.util
import json
import random
import shlex
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mlm = _load("megatron_lm")


def _megatron_line(it: int, total: int, ms: float, tflops: float, loss: float, gbs: int) -> str:
    # the format strings of megatron/training/training.py's training_log
    s = " [2026-12-02 05:00:00.000000]"
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {it * gbs:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {3e-4:.6E} |"
    s += f" global batch size: {gbs:5d} |"
    s += " {}: {:.6E} |".format("lm loss", loss)
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {1.234:.3f} |"
    return s


def test_parse_and_summarize_against_independent_arithmetic():
    rng = random.Random(7)
    total, gbs, seq, warmup = 12, 16, 2048, 3
    ms = [round(rng.uniform(300, 900), 1) for _ in range(total)]
    tf = [round(rng.uniform(100, 400), 1) for _ in range(total)]
    loss = [10.0 - 0.3 * i + rng.uniform(-0.01, 0.01) for i in range(total)]
    lines = ["> compiling dataset index builder ...", "noise iteration without fields"]
    for i in range(total):
        lines.append(_megatron_line(i + 1, total, ms[i], tf[i], loss[i], gbs))
        if i in (0, 1):
            lines.append(
                f"[Rank 0] (after {i + 1} iterations) memory (MB) | allocated: 100.00 | "
                f"max allocated: {5000.5 + i * 10:.2f} | reserved: 6000.00 | max reserved: 6000.00"
            )
    parsed = mlm.parse_log("\n".join(lines))
    assert [r["iteration"] for r in parsed["iterations"]] == list(range(1, total + 1))
    assert parsed["max_allocated_mb"] == pytest.approx(5010.5)
    s = mlm.summarize(parsed, seq, warmup)
    want_ms = statistics.median(ms[warmup:])
    assert s["ms_per_iter"] == pytest.approx(want_ms)
    assert s["tokens_per_s"] == pytest.approx(gbs * seq / (want_ms / 1000))
    assert s["tflops_per_gpu"] == pytest.approx(statistics.median(tf[warmup:]))
    assert s["first_loss"] == pytest.approx(loss[0], rel=1e-6)
    assert s["last_loss"] == pytest.approx(loss[-1], rel=1e-6)
    assert s["ms_spread"] == [min(ms[warmup:]), max(ms[warmup:])]
    assert s["timed_iterations"] == total - warmup


def test_summarize_refuses_a_log_without_timed_iterations():
    parsed = mlm.parse_log(_megatron_line(1, 2, 500.0, 100.0, 9.0, 8))
    with pytest.raises(ValueError, match="raise --iters"):
        mlm.summarize(parsed, 1024, warmup=3)


def test_arms_and_spec_check():
    model = mlm.MODELS["moe_proxy"]
    assert "--moe-grouped-gemm" in mlm.arm_args("te_fp8", model, plugin_grouped=False)
    assert "--moe-grouped-gemm" in mlm.arm_args("te_hybrid", model, plugin_grouped=False)
    for arm in ("plugin", "plugin_fast"):
        assert "--moe-grouped-gemm" not in mlm.arm_args(arm, model, plugin_grouped=False)
        assert "--moe-grouped-gemm" in mlm.arm_args(arm, model, plugin_grouped=True)
    assert "--fp8-recipe blockwise" in mlm.arm_args("te_fp8", mlm.MODELS["gpt125m"], False)
    fast = mlm.arm_args("plugin_fast", mlm.MODELS["llama8b_4l"], False)
    assert mlm.spec_of(fast) == ("primus_fp8_plugin.megatron", "fp8_gpt_fast_layer_spec")
    for flag in ("--transformer-impl local", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                 "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                 "--no-create-attention-mask-in-dataloader"):  # fmt: skip
        assert flag in fast
    hybrid = mlm.arm_args("te_hybrid", mlm.MODELS["gpt125m"], False)
    assert "--transformer-impl transformer_engine" in hybrid and "--fp8-format" not in hybrid
    assert mlm.spec_of(hybrid) == ("primus_fp8_plugin.megatron", "fp8_te_gpt_layer_spec")
    with pytest.raises(SystemExit, match="unknown arm"):
        mlm.arm_args("nope", model, False)


def test_fp8_weight_arms_and_the_distributed_optimizer(monkeypatch):
    """The FP8-weight arms are their base arms' flags with PRIMUS_FP8_PARAMS=1; TE's FP8 parameter gather runs only
    with --distributed-optimizer, which every arm then gets."""
    monkeypatch.delenv("PRIMUS_FP8_PARAMS", raising=False)
    model = mlm.MODELS["llama70b_2l"]
    for arm, base in (("plugin_fp8w", "plugin"), ("plugin_fast_fp8w", "plugin_fast")):
        assert mlm.arm_args(arm, model, False) == mlm.arm_args(base, model, False)
        assert mlm.arm_env(arm)["PRIMUS_FP8_PARAMS"] == "1" and "PRIMUS_FP8_PARAMS" not in mlm.arm_env(base)
    assert mlm.arm_args("te_fp8_pg", model, False) == mlm.arm_args("te_fp8", model, False) + " --fp8-param-gather"
    names = ["plugin_fast_fp8w", "te_fp8_pg", "te_bf16"]
    with pytest.raises(ValueError, match=r"\['te_fp8_pg'\]: .*--distributed-optimizer"):
        mlm.plan_arms(names, {}, model, False, distributed_optimizer=False)
    plans = mlm.plan_arms(names, {"mine": "--foo"}, model, False, distributed_optimizer=True)
    assert [n for n, _ in plans] == names and all(f.endswith(" --use-distributed-optimizer") for _, f in plans)
    assert mlm.plan_arms(["mine"], {"mine": "--foo"}, model, False, False) == [("mine", "--foo")]
    assert "--hidden-size 8192 --ffn-hidden-size 28672" in model["args"] and "--seq-length 4096" in model["args"]


def test_graph_arms_are_their_eager_arms_under_megatrons_local_cuda_graphs():
    for name, model in mlm.MODELS.items():
        for base in ("plugin_fast", "te_bf16", "te_fp8"):
            eager, graphed = mlm.arm_args(base, model, False), mlm.arm_args(f"{base}_graph", model, False)
            assert graphed.split() == [*eager.split(), "--cuda-graph-impl", "local"], (name, base, graphed)
            assert graphed.split().count("--cuda-graph-impl") == 1
    fast = mlm.arm_args("plugin_fast_graph", mlm.MODELS["gpt125m"], False)
    assert "--transformer-impl local" in fast and "transformer_engine" not in fast  # graphs without TE
    assert mlm.spec_of(fast) == ("primus_fp8_plugin.megatron", "fp8_gpt_fast_layer_spec")
    assert "--transformer-impl transformer_engine" in mlm.arm_args("te_bf16_graph", mlm.MODELS["gpt125m"], False)
    with pytest.raises(SystemExit, match="unknown arm"):
        mlm.arm_args("plugin_graph", mlm.MODELS["gpt125m"], False)  # only the arms of GRAPH_ARMS have a twin
    # the single grouped weight under graphs: the graph arm's flags, the single arm's environment
    moe = mlm.MODELS["qwen3_30b_a3b_proxy"]
    assert mlm.arm_args("plugin_fast_single_graph", moe, False) == mlm.arm_args("plugin_fast_graph", moe, False)
    assert mlm.arm_env("plugin_fast_single_graph")["PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT"] == "1"


def megatron_args(monkeypatch, model: dict, *extra: str):
    """Megatron-LM's parsed and validated arguments for ``pretrain_gpt.py`` with the benchmark's common flags, the
    model's and ``extra`` (skips where ``megatron.training`` does not import: it needs Python >= 3.12)."""
    try:
        from megatron.training.arguments import parse_args, validate_args
    except Exception as err:  # noqa: BLE001 - megatron.training fails to import in many ways on older Pythons
        pytest.skip(f"megatron.training does not import here: {type(err).__name__}: {err}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["pretrain_gpt.py", *shlex.split(mlm.COMMON), *shlex.split(model["args"]), "--train-iters", "10"]
    monkeypatch.setattr(sys, "argv", argv + [a for flags in extra for a in shlex.split(flags)])
    args = parse_args()
    validate_args(args)
    return args


def test_megatron_accepts_the_graph_arms_flags(monkeypatch):
    """Megatron-LM's own argument parser and validation take each graph arm's full command line."""
    model = mlm.MODELS["gpt125m"]
    for arm in ("plugin_fast_graph", "te_bf16_graph"):
        args = megatron_args(monkeypatch, model, mlm.arm_args(arm, model, False))
        assert args.cuda_graph_impl == "local" and not args.cuda_graph_modules, arm
        if arm == "plugin_fast_graph":  # Megatron's own graph-safe RNG tracker, no TE
            assert args.transformer_impl == "local" and not args.te_rng_tracker
            assert not args.create_attention_mask_in_dataloader and not args.gradient_accumulation_fusion
            assert args.spec == ["primus_fp8_plugin.megatron", "fp8_gpt_fast_layer_spec"]
        else:  # Megatron switches TE's RNG tracker on for TE layers under graphs
            assert args.transformer_impl == "transformer_engine" and args.te_rng_tracker


def test_spec_check_builds_each_plugin_arm_and_refuses_bad_specs():
    pytest.importorskip("megatron.core")
    want = {  # (model, arm): what the spec check must report
        ("gpt125m", "plugin"): ["Fp8LayerNormColumnParallelLinear", "DotProductAttention", "LayerNorm"],
        ("llama8b_4l", "plugin_fast"): ["Fp8LayerNormColumnParallelLinear", "Fp8RowParallelLinear",
                                        "Fp8FastSelfAttention/SdpaAttention", "RMSNorm"],
        ("moe_proxy", "plugin_fast"): ["Fp8ColumnParallelGroupedLinear", "SdpaAttention"],  # config-reading: grouped
        ("moe_proxy", "plugin"): ["Fp8Experts"],  # the object spec decides when the layer is built
        ("gpt125m", "plugin_fast_graph"): ["Fp8LayerNormColumnParallelLinear", "SdpaAttention", "LayerNorm"],
        ("llama70b_2l", "plugin_fast_fp8w"): ["Fp8LayerNormColumnParallelLinear", "SdpaAttention", "RMSNorm"],
    }  # fmt: skip
    def check(case):  # each check is a fresh interpreter: two at a time
        (name, arm), parts = case
        model = mlm.MODELS[name]
        return mlm.check_spec(mlm.arm_args(arm, model, plugin_grouped=True), model["args"], arm), parts

    def refused(args_str):
        try:
            mlm.check_spec(args_str)
        except SystemExit as err:
            return str(err)
        return "not refused"

    bad = {  # --spec MODULE NAME: what the refusal says
        "--spec no_such_module_xyz fn": "importing no_such_module_xyz failed",
        "--spec primus_fp8_plugin.megatron no_such_name": "has no attribute 'no_such_name'",
        "--spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec":
            "none of primus_fp8_plugin's FP8 layers",
    }
    with ThreadPoolExecutor(2) as pool:
        checked = list(pool.map(check, want.items()))
        messages = list(pool.map(refused, bad))
    for summary, parts in checked:
        assert summary.startswith("check_spec: OK") and all(p in summary for p in parts), summary
    for message, why in zip(messages, bad.values()):
        assert why in message, message
    assert mlm.check_spec(mlm.arm_args("te_bf16", mlm.MODELS["gpt125m"], False)) is None  # no --spec: nothing to check
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:  # without TE the hybrid arm is refused before anything runs, naming TE
        with pytest.raises(SystemExit, match="needs NVIDIA Transformer Engine"):
            mlm.check_spec(mlm.arm_args("te_hybrid", mlm.MODELS["gpt125m"], False))


def test_table_prints_every_figure_of_each_arm(capsys):
    rows = [
        {"arm": "te_fp8", "ms_per_iter": 400.0, "tokens_per_s": 81920.0, "tflops_per_gpu": 300.5, "first_loss": 10.5,
         "last_loss": 7.25, "max_allocated_mb": 51234.0, "fp8_layers": None},
        {"arm": "plugin_fast", "ms_per_iter": 380.0, "tokens_per_s": 86231.6, "tflops_per_gpu": 316.3,
         "first_loss": 10.5, "last_loss": 7.5, "max_allocated_mb": 49876.0, "fp8_layers": 16},
        {"arm": "te_hybrid", "rc": 1, "log": "x.log"},
    ]  # fmt: skip
    mlm.print_table(rows, "te_fp8")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split(" | ") == ["arm", "ms/iter", "vs te_fp8", "tokens/s", "TFLOP/s", "first loss", "last loss",
                                   "max alloc MB", "FP8 layers"]  # fmt: skip
    assert out[3].split(" | ") == ["plugin_fast", "380.0", f"{400 / 380:.3f}x", "86232", "316.3", "10.500000", "7.500000",
                                   "49876", "16"]  # fmt: skip
    assert out[2].split(" | ")[-1] == "-" and "failed (rc=1" in out[4]


def test_model_layer_count_is_parsed():
    log = "[primus_fp8_plugin] GPTModel holds 16 FP8 layers: {'Fp8LayerNormColumnParallelLinear': 8}\n"
    assert mlm.parse_log(log)["fp8_layers"] == 16
    assert mlm.parse_log("nothing")["fp8_layers"] is None


def test_cli_refuses_a_directory_without_pretrain_gpt(tmp_path, capsys):
    with pytest.raises(SystemExit):
        mlm.main(["--megatron-lm", str(tmp_path)])
    assert "has no pretrain_gpt.py" in capsys.readouterr().err


def test_entry_shim_usage(tmp_path, monkeypatch):
    entry = _load("megatron_lm_entry")
    monkeypatch.setattr(sys, "argv", ["megatron_lm_entry.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="usage"):
        entry.main()


def test_the_flash_arm_is_the_fast_arm_with_sdpas_flash_kernel_first(monkeypatch):
    from primus_fp8_plugin.megatron.attention import KERNELS_ENV

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    model = mlm.MODELS["llama8b_4l"]
    assert mlm.arm_args("plugin_fast_flash", model, False) == mlm.arm_args("plugin_fast", model, False)
    assert mlm.arm_env("plugin_fast_flash")[KERNELS_ENV] == "flash,efficient,math"
    assert KERNELS_ENV not in mlm.arm_env("plugin_fast") and KERNELS_ENV not in mlm.arm_env()


def test_the_mdisp_arm_is_the_fast_arm_with_megatrons_moe_dispatcher(monkeypatch):
    from primus_fp8_plugin import env

    monkeypatch.delenv(env.MOE_ROUTED, raising=False)
    model = mlm.MODELS["qwen3_30b_a3b_proxy"]
    assert mlm.arm_args("plugin_fast_mdisp", model, True) == mlm.arm_args("plugin_fast", model, True)
    assert mlm.arm_env("plugin_fast_mdisp")[env.MOE_ROUTED] == "0" and env.MOE_ROUTED not in mlm.arm_env("plugin_fast")


def test_rounds_alternate_the_order_and_combine_into_medians(tmp_path, monkeypatch, capsys):
    assert mlm.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]

    def row(arm, ms, mem, lo, hi):
        return {"arm": arm, "rc": 0, "wall_s": 10.0, "log": "x", "ms_per_iter": ms, "ms_spread": [lo, hi],
                "tokens_per_s": 32768 / (ms / 1000), "tflops_per_gpu": 1000 / ms, "first_loss": 11.0,
                "last_loss": 1.0, "max_allocated_mb": mem, "fp8_layers": 16, "timed_iterations": 5}  # fmt: skip

    combined = mlm.combine_rounds([row("a", 300.0, 100.0, 290, 310), row("a", 360.0, 120.0, 350, 420),
                                   row("a", 330.0, 110.0, 320, 340)])  # fmt: skip
    assert combined["ms_per_iter"] == 330.0 and combined["ms_rounds"] == [300.0, 360.0, 330.0]
    assert combined["tokens_per_s"] == pytest.approx(32768 / 0.330)  # recomputed from the median
    assert combined["tflops_per_gpu"] == pytest.approx(1000 / 330.0)
    assert combined["max_allocated_mb"] == 120.0 and combined["ms_spread"] == [290, 420] and combined["wall_s"] == 30.0
    failed = {"arm": "a", "rc": 1, "wall_s": 3.0, "log": "y"}
    assert mlm.combine_rounds([row("a", 300.0, 1.0, 1, 2), failed]) is failed

    (tmp_path / "pretrain_gpt.py").write_text("")
    calls = []

    def fake_run(name, flags, args, model, log_dir, tag=""):
        calls.append((name, tag))
        return row(name, {"te_fp8": 350.0, "plugin_fast": 340.0}[name] + len(calls), 1.0, 1, 2)

    monkeypatch.setattr(mlm, "run_arm", fake_run)
    monkeypatch.setattr(mlm, "check_spec", lambda *a, **k: None)
    out = tmp_path / "r.json"
    argv = ["--megatron-lm", str(tmp_path), "--arms", "plugin_fast,te_fp8", "--rounds", "2", "--log-dir",
            str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert mlm.main(argv) == 0
    assert calls == [("plugin_fast", "_r1"), ("te_fp8", "_r1"), ("te_fp8", "_r2"), ("plugin_fast", "_r2")]
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and [r["arm"] for r in data["rows"]] == ["plugin_fast", "te_fp8"]
    assert data["rows"][0]["ms_rounds"] == [341.0, 344.0] and data["rows"][0]["ms_per_iter"] == 342.5
    text = capsys.readouterr().out
    assert "median of 2 rounds" in text and "341.0 / 344.0" in text
    with pytest.raises(SystemExit):
        mlm.main([*argv[:6], "0"])


def test_fine_grained_moe_proxies_run_grouped_experts_in_every_arm():
    for name, experts, topk, ffn in (("qwen3_30b_a3b_proxy", 128, 8, 768), ("dsv3_proxy", 64, 8, 2048)):
        model = mlm.MODELS[name]
        flags = shlex.split(model["args"])
        value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
        assert (int(value["--num-experts"]), int(value["--moe-router-topk"]), int(value["--moe-ffn-hidden-size"])) == (
            experts, topk, ffn)  # fmt: skip
        assert value["--hidden-size"] == "2048" and value["--seq-length"] == "4096" and model["moe"]
        for arm in ("plugin_fast", "te_fp8", "te_bf16"):
            assert "--moe-grouped-gemm" in mlm.arm_args(arm, model, plugin_grouped=False), (name, arm)
    assert "--moe-shared-expert-intermediate-size 2048" in mlm.MODELS["dsv3_proxy"]["args"]
    assert "--qk-layernorm" in mlm.MODELS["qwen3_30b_a3b_proxy"]["args"]


def test_profile_flags_and_their_checks(tmp_path, capsys):
    flags = mlm.profile_args(7, tmp_path / "p")
    want = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "7", "--profile-step-end", "8",
            "--tensorboard-dir", str(tmp_path / "p" / "tensorboard")]  # fmt: skip
    assert shlex.split(flags) == want
    assert shlex.split(mlm.profile_args(7, tmp_path / "p", callstacks=True)) == [*want, "--pytorch-profiler-collect-callstack"]
    (tmp_path / "pretrain_gpt.py").write_text("")
    with pytest.raises(SystemExit):
        mlm.main(["--megatron-lm", str(tmp_path), "--profile", "--iters", "10", "--warmup", "5", "--profile-step", "3"])
    assert "must lie after the warm-up" in capsys.readouterr().err


def test_table_shows_the_profiled_gpu_busy_share(capsys):
    rows = [{"arm": "plugin_fast", "ms_per_iter": 400.0, "tokens_per_s": 1.0, "tflops_per_gpu": 1.0, "first_loss": 1.0,
             "last_loss": 1.0, "max_allocated_mb": 1.0, "fp8_layers": 4, "profile": {"busy_share": 0.3214}},
            {"arm": "te_fp8", "ms_per_iter": 500.0, "tokens_per_s": 1.0, "tflops_per_gpu": 1.0, "first_loss": 1.0,
             "last_loss": 1.0, "max_allocated_mb": 1.0, "fp8_layers": None}]  # fmt: skip
    mlm.print_table(rows, "te_fp8")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split(" | ")[-1] == "GPU busy"
    assert out[2].split(" | ")[-1] == "32.1%" and out[3].split(" | ")[-1] == "-"


def test_megatron_accepts_the_moe_proxies_and_profile_flags(monkeypatch, tmp_path):
    """Megatron-LM's own parser and validation take the proxies' command lines with ``--profile``."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # --moe-grouped-gemm asks (H200)
    for name in ("qwen3_30b_a3b_proxy", "dsv3_proxy"):
        model = mlm.MODELS[name]
        for arm in ("plugin_fast", "te_fp8", "te_bf16"):
            args = megatron_args(monkeypatch, model, mlm.arm_args(arm, model, False), mlm.profile_args(8, tmp_path))
            assert args.moe_grouped_gemm and args.num_experts in (64, 128) and args.profile, (name, arm)
            assert args.use_pytorch_profiler and (args.profile_step_start, args.profile_step_end) == (8, 9)


def test_callstacks_follow_the_installed_megatron(tmp_path, monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    training = tmp_path / "megatron" / "training"
    (training / "config").mkdir(parents=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(training)]))
    assert not mlm.megatron_records_callstacks()  # megatron-core before 0.19: no config package
    (training / "config" / "common_config.py").write_text("    pytorch_profiler_collect_shapes: bool = False\n")
    assert not mlm.megatron_records_callstacks()
    (training / "config" / "common_config.py").write_text("    pytorch_profiler_collect_callstack: bool = False\n")
    assert mlm.megatron_records_callstacks()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not mlm.megatron_records_callstacks()


def test_profiled_arms_are_compared_kernel_by_kernel_with_the_reference(capsys):
    def profile(adds):
        return {"top_kernels": [{"name": "gemm", "count": 4, "ms": 2.0}, {"name": "copy", "count": adds, "ms": 0.01 * adds}]}

    rows = [{"arm": "plugin_fast", "profile": profile(10)}, {"arm": "te_fp8"},
            {"arm": "plugin_fast_mdisp", "profile": profile(4)}]  # fmt: skip
    mlm.print_kernel_differences(rows, "plugin_fast_mdisp")
    out = capsys.readouterr().out
    assert "plugin_fast_mdisp (A) -> plugin_fast (B)" in out and "     4 ->     10      +6" in out
    mlm.print_kernel_differences([rows[1]], "te_fp8")  # nothing profiled: nothing printed
    assert capsys.readouterr().out == ""


def test_the_run_says_where_megatrons_multi_tensor_kernels_come_from(monkeypatch):
    found = set()

    def import_module(name):
        if name not in found:
            raise ImportError(name)

    monkeypatch.setattr(mlm.importlib, "import_module", import_module)
    fallback = mlm.multi_tensor_kernels()
    assert fallback.startswith("Megatron's Python fallbacks") and "host read per parameter" in fallback
    found.add("amp_C")  # apex's kernels without apex's applier: no source
    assert mlm.multi_tensor_kernels() == fallback
    found.add("apex.multi_tensor_apply")
    assert mlm.multi_tensor_kernels() == "apex"
    found.add("transformer_engine.pytorch.optimizers")
    assert mlm.multi_tensor_kernels() == "TE"


def test_each_row_records_the_environment_its_arm_ran_with(tmp_path, monkeypatch):
    """Arms that differ only by environment (FP8 primary weights, the single grouped weight) say so in their rows:
    their Megatron flags are another arm's."""
    import argparse
    import types

    seen = {}

    def fake_run(cmd, stdout, stderr, env):
        seen.update(env)
        return types.SimpleNamespace(returncode=1)  # a failed run: its row is returned before any parsing

    monkeypatch.setattr(mlm.subprocess, "run", fake_run)
    args = argparse.Namespace(profile=False, profile_step=0, megatron_lm=tmp_path, iters=2, memory_peak=False)
    model = mlm.MODELS["llama8b_4l"]
    def run(arm):
        return mlm.run_arm(arm, mlm.arm_args(arm, model, plugin_grouped=False), args, model, tmp_path)

    row = run("plugin_fast_fp8w")
    assert row["env"] == {"PRIMUS_FP8_PARAMS": "1"} and seen["PRIMUS_FP8_PARAMS"] == "1"
    assert run("plugin_fast")["env"] == {}


def test_memory_peak_asks_the_entry_for_a_report_and_prints_it(tmp_path, monkeypatch, capsys):
    """``--memory-peak``: the arm's environment names the report file (the entry shim records the allocator's trace
    and writes ``tools/memory_peak.py``'s report there at exit); the row carries it and the run prints it."""
    import argparse
    import types

    seen = {}

    def fake_run(cmd, stdout, stderr, env):
        seen.update(env)
        stdout.write("\n".join(_megatron_line(i + 1, 3, 500.0, 100.0, 9.0, 16) for i in range(3)) + "\n")
        report = {"peak_bytes": 3 * 2**30, "start_bytes": 0, "end_bytes": 2**30, "events": 10, "peak_event_index": 7,
                  "peak_site": "primus_fp8_plugin/ops/core.py:10(forward)", "peak_phase": "forward",
                  "by_phase": {"forward": 3 * 2**30}, "other_sites_bytes": 0,
                  "by_site": [["primus_fp8_plugin/ops/core.py:10(forward)", "forward", 3 * 2**30, 4]],
                  "timeline": [[3, 2**30], [7, 3 * 2**30], [9, 2**30]]}  # fmt: skip
        Path(env["PRIMUS_FP8_MEMORY_PEAK"]).write_text(json.dumps(report))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(mlm.subprocess, "run", fake_run)
    model = mlm.MODELS["llama8b_4l"]
    args = argparse.Namespace(profile=False, profile_step=0, megatron_lm=tmp_path, iters=3, warmup=1, memory_peak=True)
    row = mlm.run_arm("plugin_fast", mlm.arm_args("plugin_fast", model, plugin_grouped=False), args, model, tmp_path)
    assert seen["PRIMUS_FP8_MEMORY_PEAK"] == str(tmp_path / "memory_peak_plugin_fast.json")
    assert row["memory_peak"]["peak_bytes"] == 3 * 2**30 and "timeline" not in row["memory_peak"]
    assert (tmp_path / "memory_peak_plugin_fast.png").is_file()
    out = capsys.readouterr().out
    assert "peak allocated: 3,072.0 MiB at event 7 of 10 (forward: primus_fp8_plugin/ops/core.py:10(forward))" in out


def test_an_earlier_runs_memory_report_is_never_read_as_this_ones(tmp_path, monkeypatch, capsys):
    import argparse
    import types

    stale = tmp_path / "memory_peak_plugin_fast.json"
    stale.write_text(json.dumps({"peak_bytes": 1}))

    def fake_run(cmd, stdout, stderr, env):  # this run ends without writing a report
        stdout.write("\n".join(_megatron_line(i + 1, 3, 500.0, 100.0, 9.0, 16) for i in range(3)) + "\n")
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(mlm.subprocess, "run", fake_run)
    model = mlm.MODELS["llama8b_4l"]
    args = argparse.Namespace(profile=False, profile_step=0, megatron_lm=tmp_path, iters=3, warmup=1, memory_peak=True)
    row = mlm.run_arm("plugin_fast", mlm.arm_args("plugin_fast", model, plugin_grouped=False), args, model, tmp_path)
    assert "memory_peak" not in row and not stale.exists()
    assert "--memory-peak wrote no report" in capsys.readouterr().out


def test_entry_shim_records_the_trace_only_when_asked():
    text = (ROOT / "benchmarks" / "megatron_lm_entry.py").read_text()
    assert 'os.environ.get("PRIMUS_FP8_MEMORY_PEAK")' in text and "_record_memory_history" in text
