"""Make a wrong ``--spec`` loud: Megatron-LM logs one ERROR line and trains its default spec when the
``--spec MODULE NAME`` import fails.

Before a launch::

    python -m primus_fp8_plugin.megatron.check_spec MODULE NAME [pretrain_gpt.py flags ...]

imports ``MODULE``, takes ``NAME``, builds the spec as Megatron would (a ``ModuleSpec`` or block spec as it
is; a callable as ``NAME(config, vp_stage=None)``, ``config`` a ``TransformerConfig`` from the flags it knows:
``--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention
--num-query-groups --normalization --qk-layernorm --swiglu --num-experts --moe-grouped-gemm --moe-router-topk
--fp8-format``; the others are ignored), checks that it holds the plugin's FP8 linears and prints one line
saying what it built (exit 0), or one line saying what is wrong and what to do (exit 2).

After the model is built: ``install_model_check()`` makes every ``GPTModel`` constructed afterwards count the
plugin's FP8 layers it holds, print the count, and raise if there are none (``benchmarks/megatron_lm_entry.py``
installs it when ``PRIMUS_FP8_CHECK_MODEL=1``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import inspect
import sys
import warnings
from functools import partial

EXIT_BAD_SPEC = 2


class SpecError(Exception):
    """A ``--spec`` that Megatron would not build as meant (the message says what to do)."""


def _fp8_classes() -> tuple:
    from .grouped import Fp8GroupedLinearBase
    from .layers import Fp8MegatronLinear

    return (Fp8MegatronLinear, Fp8GroupedLinearBase)


def spec_modules(node, seen=None) -> list:
    """Every module class (or builder object) a spec tree names, depth first."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    out = [] if seen is None else seen
    if isinstance(node, ModuleSpec):
        out.append(node.module)
        spec_modules(node.submodules, out)
        for v in (node.params or {}).values():  # e.g. an experts builder for megatron-core 0.16 (compat.py)
            if callable(v) or isinstance(v, (ModuleSpec, list, tuple)):
                spec_modules(v, out)
    elif isinstance(node, partial):
        out.append(getattr(node.func, "__self__", node.func))
        for v in (*node.args, *node.keywords.values()):
            spec_modules(v, out)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            spec_modules(getattr(node, f.name), out)
    elif isinstance(node, (list, tuple)):
        for v in node:
            spec_modules(v, out)
    elif node is not None:
        out.append(node)
    return out


def fp8_modules_in_spec(spec) -> list[str]:
    """Names of the plugin's FP8 layer classes (and FP8 expert builders) a spec names."""
    from .grouped import Fp8Experts

    fp8 = _fp8_classes()
    names = []
    for m in spec_modules(spec):
        if isinstance(m, Fp8Experts) or (isinstance(m, partial) and isinstance(m.func, type) and issubclass(m.func, fp8)):
            names.append(type(m).__name__ if isinstance(m, Fp8Experts) else m.func.__name__)
        elif isinstance(m, type) and issubclass(m, fp8):
            names.append(m.__name__)
    return names


def config_from_flags(flags: list[str]):
    """A ``TransformerConfig`` from the pretrain_gpt.py flags that decide a layer spec (others ignored)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--ffn-hidden-size", type=int)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--group-query-attention", action="store_true")
    ap.add_argument("--num-query-groups", type=int)
    ap.add_argument("--normalization", default="LayerNorm")
    ap.add_argument("--qk-layernorm", action="store_true")
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--num-experts", type=int)
    ap.add_argument("--moe-grouped-gemm", action="store_true")
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--fp8-format")
    a, _ = ap.parse_known_args(flags)
    kw = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
              ffn_hidden_size=a.ffn_hidden_size, normalization=a.normalization, qk_layernorm=a.qk_layernorm,
              num_query_groups=a.num_query_groups if a.group_query_attention else None, fp8=a.fp8_format,
              use_cpu_initialization=True)  # fmt: skip
    if a.swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if a.num_experts:
        kw.update(num_moe_experts=a.num_experts, moe_grouped_gemm=a.moe_grouped_gemm, moe_router_topk=a.moe_router_topk)
    return TransformerConfig(**kw)


def build_spec(module: str, name: str, config):
    """Import ``module``, take ``name`` and build it as Megatron-LM does; raises ``SpecError``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    where = f"--spec {module} {name}"
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure, with its cause
        raise SpecError(f"{where}: importing {module} failed ({type(err).__name__}: {one_line(err)}). Megatron-LM would "
                        "log one ERROR line and train its default spec. Put this repository on PYTHONPATH (or pip "
                        "install it) and install its Megatron extras") from err  # fmt: skip
    if name not in vars(mod):  # Megatron-LM reads vars(module)[name]
        try:  # a package whose own imports failed keeps the error for its names (primus_fp8_plugin.megatron)
            getattr(mod, name, None)
        except ImportError as err:
            raise SpecError(f"{where}: {one_line(err)}. Megatron-LM would log one ERROR line and train its default "
                            "spec") from err  # fmt: skip
        known = sorted(n for n, v in vars(mod).items() if not n.startswith("_") and "spec" in n and
                       (isinstance(v, ModuleSpec) or callable(v)))  # fmt: skip
        raise SpecError(f"{where}: {module} has no attribute {name!r} (specs there: {', '.join(known) or 'none'})")
    obj = vars(mod)[name]
    if not isinstance(obj, ModuleSpec) and callable(obj) and not isinstance(obj, type):
        try:
            if "vp_stage" in inspect.signature(obj).parameters:
                obj = obj(config, vp_stage=None)
            else:
                obj = obj(config)
        except Exception as err:  # noqa: BLE001 - report the builder's own message
            raise SpecError(f"{where}: building the spec for this config failed: {type(err).__name__}: {err}") from err
    return obj


def check(module: str, name: str, flags: list[str] = ()) -> str:
    """The one-line summary of a good spec; raises ``SpecError`` otherwise."""
    _fp8_classes()  # the plugin's Megatron layers import (an ImportError says what is missing: compat.py)
    try:
        config = config_from_flags(list(flags))
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001
        raise SpecError(f"these flags make no valid TransformerConfig: {type(err).__name__}: {err}") from err
    spec = build_spec(module, name, config)
    fp8 = fp8_modules_in_spec(spec)
    if not fp8:
        raise SpecError(f"--spec {module} {name}: the spec holds none of primus_fp8_plugin's FP8 layers "
                        f"(got {type(spec).__name__}); it would train without the plugin")  # fmt: skip
    mods = {getattr(m, "__name__", type(m).__name__) for m in spec_modules(spec)}
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(collections.Counter(fp8).items()))
    attn = next((m for m in ("Fp8FastSelfAttention", "SelfAttention") if m in mods), "?")
    core = next((m for m in ("SdpaAttention", "Fp8TEDotProductAttention", "TEDotProductAttention", "DotProductAttention")
                 if m in mods), "?")  # fmt: skip
    return (f"check_spec: OK --spec {module} {name} -> {type(spec).__name__}; FP8 layers: {counts}; "
            f"attention {attn}/{core}; normalization {config.normalization}")  # fmt: skip


def model_fp8_layers(model) -> collections.Counter:
    """The plugin's FP8 layer classes a built model (or list of model chunks) holds, with their counts."""
    fp8 = _fp8_classes()
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return collections.Counter(type(m).__name__ for c in chunks for m in c.modules() if isinstance(m, fp8))


def install_model_check(*, require: bool = True, out=None) -> None:
    """Make every ``GPTModel`` built from now on print how many of the plugin's FP8 layers it holds and, with
    ``require``, raise ``RuntimeError`` when it holds none (the ``--spec`` did not take effect)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if getattr(GPTModel.__init__, "_primus_fp8_checked", False):
        return
    original = GPTModel.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        found = model_fp8_layers(self)
        stream = out or sys.stdout
        print(f"[primus_fp8_plugin] GPTModel holds {sum(found.values())} FP8 layers: {dict(sorted(found.items()))}",
              file=stream, flush=True)  # fmt: skip
        if require and not found:
            raise RuntimeError("primus_fp8_plugin: the model holds none of the plugin's FP8 layers: the --spec did not "
                               "take effect (Megatron-LM trains its default spec when the --spec import fails; "
                               "run python -m primus_fp8_plugin.megatron.check_spec MODULE NAME)")  # fmt: skip

    __init__._primus_fp8_checked = True
    __init__.__wrapped__ = original
    GPTModel.__init__ = __init__


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0].startswith("-") or argv[1].startswith("-"):
        print("usage: python -m primus_fp8_plugin.megatron.check_spec MODULE NAME [pretrain_gpt.py flags ...]",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_SPEC
    try:
        with warnings.catch_warnings():  # Megatron's notices (absent apex / TE fallbacks) are not this check's
            warnings.filterwarnings("ignore", module=r"megatron\.")
            print(check(argv[0], argv[1], argv[2:]), flush=True)
    except SpecError as err:
        print(f"check_spec: FAILED {one_line(err)}", file=sys.stderr, flush=True)
        return EXIT_BAD_SPEC
    except ImportError as err:  # the plugin's own Megatron modules: megatron-core absent or unsupported (compat.py)
        from . import explained

        print(f"check_spec: FAILED {one_line(explained(err))}", file=sys.stderr, flush=True)
        return EXIT_BAD_SPEC
    return 0


def one_line(err: BaseException) -> str:
    """An error's message on one line."""
    return " ".join(str(err).split())


if __name__ == "__main__":
    sys.exit(main())
