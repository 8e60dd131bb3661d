"""Check docs/INTEGRATION.md's Primus override inside a user's Primus checkout: on the CPU, a tiny dense model
(Primus's Llama-3 preset) and a tiny MoE model (its Mixtral preset) go through Primus's own config loader
(``load_primus_config``) and Megatron argument builder, the argument validation of the Megatron-LM Primus
pins, and Primus's model provider (that Megatron-LM's ``gpt_builder``, which imports ``spec``); each model
must hold the plugin's FP8 layers and train a few steps with a falling loss.

    python scripts/check_primus.py --primus PATH/TO/Primus [--megatron PATH/TO/Megatron-LM]

Primus is not pip-installable: ``--primus`` is a checkout (``git clone --recursive``); ``--megatron`` defaults
to its ``third_party/Megatron-LM`` submodule. Needs the Python packages Primus's loader and Megatron-LM's
``megatron.training`` import (pyyaml, loguru, pydantic, triton, ...) beside this repository's
``.[megatron]``. GPUs are hidden: the check runs on the CPU. One line per model; exit status 0 when both
pass, 1 when a check fails, 2 when a path is not what it should be.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2

# docs/INTEGRATION.md's override, key for key (tests/megatron/test_check_primus.py keeps the two equal)
OVERRIDES = {
    "dense": {"spec": ["primus_fp8_plugin.megatron", "fp8_gpt_fast_dense_spec"]},
    "moe": {"spec": ["primus_fp8_plugin.megatron", "fp8_gpt_fast_moe_spec"]},
    "common": {
        "fp8": None,
        "use_turbo_gemm": False,
        "create_attention_mask_in_dataloader": False,
        "transformer_impl": "local",
        "no_persist_layer_norm": True,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
    },
}
# Primus's presets, made tiny; what a CPU run needs (CPU weights, no token dispatch through CUDA streams)
MODELS = {
    "dense": ("llama3_8B.yaml", {}),
    "moe": ("mixtral_8x7B_v0.1.yaml", {"num_experts": 4, "moe_ffn_hidden_size": 256}),
}
TINY = {
    "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4, "num_query_groups": 2,
    "seq_length": 64, "max_position_embeddings": 64, "micro_batch_size": 2, "global_batch_size": 2,
    "train_iters": 5, "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 512,
    "use_cpu_initialization": True, "moe_token_dispatcher_type": "allgather",
}  # fmt: skip


class CheckError(Exception):
    """A check that failed (the message says which and what was seen)."""


def yaml_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(f'"{x}"' for x in v) + "]"
    return str(v)


def experiment_yaml(kind: str, workspace: Path) -> str:
    """A Primus experiment file: the preset, docs/INTEGRATION.md's override, the tiny CPU model."""
    preset, extra = MODELS[kind]
    overrides = {**OVERRIDES[kind], **OVERRIDES["common"], **TINY, **extra}
    lines = [
        "work_group: primus_fp8_plugin", "user_name: check", f"exp_name: check_{kind}", f"workspace: {workspace}",
        "modules:", "  pre_trainer:", "    framework: megatron", "    config: pre_trainer.yaml", f"    model: {preset}",
        "    overrides:", *(f"      {k}: {yaml_value(v)}" for k, v in overrides.items()),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def git(path: Path, *command: str) -> str:
    """``git -C path command`` 's output, or "" where it fails (no git, not a checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(path), *command], capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def locate(primus: Path, megatron: Path | None) -> tuple[Path, Path]:
    """The checkouts, or a ``CheckError`` saying plainly what is missing and what to do."""
    if not (primus / "primus" / "core" / "config" / "primus_config.py").is_file():
        raise CheckError(f"--primus {primus}: not a Primus checkout (no primus/core/config/primus_config.py). Primus is "
                         "not pip-installable: git clone --recursive https://github.com/AMD-AGI/Primus and pass its path")
    megatron = megatron or primus / "third_party" / "Megatron-LM"
    if not (megatron / "megatron" / "training" / "arguments.py").is_file():
        hint = (f"git -C {primus} submodule update --init third_party/Megatron-LM, or pass --megatron PATH"
                if megatron == primus / "third_party" / "Megatron-LM" else "pass the Megatron-LM checkout Primus pins")
        raise CheckError(f"--megatron {megatron}: no Megatron-LM there (megatron/training/arguments.py missing): {hint}")
    return primus, megatron


def describe(primus: Path, megatron: Path) -> str:
    import ast

    values = {}
    for node in ast.parse((megatron / "megatron" / "core" / "package_info.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    version = f"{values.get('MAJOR')}.{values.get('MINOR')}.{values.get('PATCH')}{values.get('PRE_RELEASE', '')}"
    pinned = git(primus, "ls-tree", "HEAD", "third_party/Megatron-LM").split()  # mode, "commit", sha, path
    head, actual = git(primus, "rev-parse", "--short=12", "HEAD"), git(megatron, "rev-parse", "--short=12", "HEAD")
    return (f"Primus {primus} (commit {head or 'unknown: not a git checkout'}; pins Megatron-LM "
            f"{pinned[2][:12] if len(pinned) > 2 else 'unknown'}), Megatron-LM {megatron} ({version}, commit "
            f"{actual or 'unknown: not a git checkout'})")  # fmt: skip


def megatron_args(kind: str, workdir: Path):
    """Primus's config loader and argument builder on the experiment file, then the pinned Megatron-LM's
    ``validate_args``; raises ``CheckError`` where an override did not arrive."""
    from unittest import mock

    from megatron.training.arguments import validate_args
    from primus.backends.megatron.megatron_adapter import MegatronAdapter
    from primus.core.config.primus_config import get_module_config, load_primus_config

    exp = workdir / f"check_{kind}.yaml"
    exp.write_text(experiment_yaml(kind, workdir / "output"))
    module = get_module_config(load_primus_config(exp), "pre_trainer")
    args = argparse.Namespace(**vars(MegatronAdapter().convert_config(module.params)))
    wanted = {**OVERRIDES[kind], **OVERRIDES["common"]}
    lost = [f"{k}={getattr(args, k, getattr(module.params, k, '<absent>'))!r} (wanted {v!r})" for k, v in wanted.items()
            if getattr(args, k, getattr(module.params, k, "<absent>")) != v]  # fmt: skip
    if lost:
        raise CheckError(f"Primus's config did not keep the override: {', '.join(lost)}")
    # validate_args asks the GPU's compute capability for grouped GEMMs (>= 8.0): answer for the hidden GPU
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    args.padded_vocab_size = args.vocab_size  # what the tokenizer set-up gives a NullTokenizer of a 128-multiple
    return args


def train(kind: str, args, steps: int) -> str:
    """Primus's model provider (the pinned Megatron-LM's gpt_builder, which imports ``spec``) builds the model;
    ``steps`` AdamW steps on one batch must lower the loss."""
    import torch
    from megatron.core.transformer.module import Float16Module
    from megatron.training.global_vars import set_args
    from primus.core.utils.import_utils import get_model_provider

    from primus_fp8_plugin.megatron.check_spec import model_fp8_layers

    set_args(args)
    torch.manual_seed(args.seed)
    with contextlib.redirect_stdout(io.StringIO()):
        model = get_model_provider()(pre_process=True, post_process=True)
    layers = model_fp8_layers(model)
    if not layers:
        raise CheckError(f"the model holds none of the plugin's FP8 layers (spec {args.spec})")
    if kind == "moe" and not any("Grouped" in name for name in layers):
        raise CheckError(f"the MoE model holds no grouped FP8 experts: {dict(layers)}")
    model = Float16Module(model.config, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    pos = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        # no attention mask: what the dataloader gives with create_attention_mask_in_dataloader: false
        loss = model(ids, pos, None, labels=ids).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)) or not losses[-1] < losses[0]:
        raise CheckError(f"the loss did not fall over {steps} steps: {[round(x, 4) for x in losses]}")
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(layers.items()))
    return f"spec {args.spec[1]}: FP8 layers {counts}; loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--primus", type=Path, required=True, help="a Primus checkout (git clone --recursive)")
    ap.add_argument("--megatron", type=Path, help="the Megatron-LM checkout (default: PRIMUS/third_party/Megatron-LM)")
    ap.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe (default both)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per model (default 4)")
    ap.add_argument("--port", type=int, default=29631, help="the gloo port of the one-process CPU world")
    a = ap.parse_args(argv)
    kinds = [k for k in a.models.split(",") if k]
    if not kinds or set(kinds) - set(MODELS) or a.steps < 2:
        print(f"check_primus: --models takes {', '.join(MODELS)} and --steps at least 2", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        primus, megatron = locate(a.primus.resolve(), a.megatron.resolve() if a.megatron else None)
    except CheckError as err:
        print(f"check_primus: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = ""  # the check runs on the CPU
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ[key] = value
    # the pinned Megatron-LM first (before any installed megatron-core), then Primus, then this repository
    sys.path[:0] = [str(megatron), str(primus), str(ROOT)]
    warnings.filterwarnings("ignore", module=r"(megatron|primus)\.")
    print(f"check_primus: {describe(primus, megatron)}", flush=True)

    import primus_fp8_plugin.megatron as plugin

    if plugin.import_error is not None:
        print(f"check_primus: FAILED: {' '.join(str(plugin.explained(plugin.import_error)).split())}", flush=True)
        return EXIT_FAILED
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    failed = 0
    with tempfile.TemporaryDirectory(prefix="check_primus_") as tmp:
        for kind in kinds:
            try:
                args = megatron_args(kind, Path(tmp))
                if kind == kinds[0]:
                    init_cpu_distributed(port=a.port)
                print(f"check_primus: OK {kind}: {train(kind, args, a.steps)}", flush=True)
            except CheckError as err:
                failed += 1
                print(f"check_primus: FAILED {kind}: {err}", flush=True)
            except Exception as err:  # noqa: BLE001 - Primus / Megatron / the spec failing: say where, go on
                failed += 1
                traceback.print_exc()
                print(f"check_primus: FAILED {kind}: {type(err).__name__}: {' '.join(str(err).split())}", flush=True)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
