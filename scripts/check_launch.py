#!/usr/bin/env python3
"""The pre-launch check of a training run: ``scripts/launch_pretrain.sh`` runs it once, before it starts
any process, on the configuration the trainer composes for the run.

    python -m primus_fp8_plugin.train --cfg job OVERRIDES... | python scripts/check_launch.py --world-size N -

Reads the composed configuration (the YAML that the trainer's ``--cfg job`` prints; ``-``: stdin) and, for
a run of ``N`` processes, checks what the trainer's start-up would check on every rank, and what it
builds: the values (``primus_fp8_plugin.config.validate``: batch sizes against the data-parallel size,
TP against heads and groups, TE present for the ``te_*`` modes, ...), the indexed dataset's files (with
``data=indexed``; read only: nothing is written), Megatron's ``TransformerConfig`` of
the run, and the decoder spec the trainer builds for ``fp8.mode`` (``training.model.layer_spec``), which
must hold the plugin's FP8 layers exactly when the mode uses them (``blockwise``, ``te_spec_blockwise``;
not ``bf16``, ``te_bf16``, ``te_blockwise``). Prints one line saying what the run builds (exit 0), or one
line saying what is wrong (exit 2). Builds no weights: it runs on a login node without GPUs.
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings

EXIT_BAD = 2
FP8_MODES_WITH_PLUGIN_LAYERS = ("blockwise", "te_spec_blockwise")
CORE_ATTENTIONS = {
    "SdpaAttention": "SDPA (fused)",
    "DotProductAttention": "Megatron's unfused DotProductAttention",
    "TEDotProductAttention": "TE's fused attention",
    "Fp8TEDotProductAttention": "TE's fused attention",
}
UNFUSED_WARN_SEQ = 2048  # from here on the unfused attention's [b*heads, s, s] scores cost more than the GEMMs


class LaunchCheckError(Exception):
    """What would stop the run (the message says what to do)."""


def load_config(text: str):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(text)
    if not hasattr(cfg, "keys") or "model" not in cfg:
        raise LaunchCheckError("the input is not a composed training configuration (python -m primus_fp8_plugin.train "
                               "--cfg job ... prints one)")  # fmt: skip
    return cfg


def layer_count(spec, num_layers: int) -> tuple[collections.Counter, set]:
    """(FP8 layer classes with their counts over the whole decoder, the names of every module class) of
    the spec the trainer builds: a block spec (every layer listed) or one layer spec (repeated)."""
    from primus_fp8_plugin.megatron.check_spec import fp8_modules_in_spec, spec_modules

    per = collections.Counter(fp8_modules_in_spec(spec))
    if not hasattr(spec, "layer_specs"):  # one layer spec, used for every layer
        per = collections.Counter({k: v * num_layers for k, v in per.items()})
    names = {getattr(m, "__name__", type(m).__name__) for m in spec_modules(spec)}
    return per, names


def check(cfg, world_size: int) -> tuple[str, list[str]]:
    """The one-line summary of the run and its notes; raises ``LaunchCheckError``."""
    from primus_fp8_plugin.config import ConfigError, validate
    from primus_fp8_plugin.config.resources import check_indexed_prefix

    try:
        validate(cfg, world_size)
        if cfg.data.source == "indexed":  # read-only; the trainer checks the directories it writes itself
            check_indexed_prefix(str(cfg.data.path))
    except ConfigError as err:
        raise LaunchCheckError(f"bad configuration for {world_size} processes: {err}") from None
    from primus_fp8_plugin.training.model import layer_spec, transformer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's notices about absent apex / TE
        try:
            transformer_config(cfg, on_cuda=False)
        except Exception as err:  # noqa: BLE001 - Megatron's own message says which field
            raise LaunchCheckError(f"Megatron's TransformerConfig refuses this model: {type(err).__name__}: {err}") from None
        try:
            spec = layer_spec(cfg)
        except Exception as err:  # noqa: BLE001 - an import or a builder's failure, with its message
            raise LaunchCheckError(
                f"building the decoder spec for fp8={cfg.fp8.mode} failed: {type(err).__name__}: {err}"
            ) from None
    m, p, mode = cfg.model, cfg.parallel, cfg.fp8.mode
    fp8, names = layer_count(spec, m.num_layers)
    want_fp8 = mode in FP8_MODES_WITH_PLUGIN_LAYERS and len({i % m.num_layers for i in cfg.fp8.bf16_layers}) < m.num_layers
    if want_fp8 and not fp8:
        raise LaunchCheckError(f"fp8={mode}: the decoder spec holds none of the plugin's FP8 layers; the run would train "
                               "without them")  # fmt: skip
    if not want_fp8 and fp8:
        raise LaunchCheckError(f"fp8={mode}: the decoder spec holds the plugin's FP8 layers ({dict(fp8)}) where it should "
                               "hold none")  # fmt: skip
    core = next((n for n in CORE_ATTENTIONS if n in names), None)
    layers = ", ".join(f"{k} x{v}" for k, v in sorted(fp8.items())) or "none (BF16 or TE's own FP8)"
    dp = world_size // (p.tp * p.pp)
    summary = (f"check_launch: OK {m.name}, {m.num_layers} layers, seq {m.seq_length}, fp8={mode}; FP8 layers: {layers}; "
               f"attention: {CORE_ATTENTIONS.get(core, core or '?')}; {world_size} processes = TP {p.tp} x PP {p.pp} "
               f"x DP {dp}")  # fmt: skip
    notes = []
    if core == "DotProductAttention" and m.seq_length >= UNFUSED_WARN_SEQ:
        notes.append(f"check_launch: note: model.attention=local at sequence {m.seq_length} writes the [b*heads, s, s] "
                     "score matrix to memory; model.attention=sdpa runs PyTorch's fused kernels (cuDNN / flash)")  # fmt: skip
    return summary, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the composed configuration (YAML from the trainer's --cfg job); - for stdin")
    ap.add_argument("--world-size", type=int, default=1, help="processes of the run (nodes x processes per node)")
    args = ap.parse_args(argv)
    try:
        text = sys.stdin.read() if args.config == "-" else open(args.config).read()
        summary, notes = check(load_config(text), args.world_size)
    except (LaunchCheckError, OSError) as err:
        print(f"check_launch: FAILED {err}", file=sys.stderr, flush=True)
        return EXIT_BAD
    except Exception as err:  # noqa: BLE001 - e.g. a missing value (???) in the configuration: one line, not a traceback
        print(f"check_launch: FAILED {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr, flush=True)
        return EXIT_BAD
    print(summary, flush=True)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
