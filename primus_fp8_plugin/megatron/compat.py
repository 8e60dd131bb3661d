"""What differs between the supported Megatron-core versions, resolved once: the plugin's other Megatron
modules take these names from here.

Supported (``SUPPORTED``): megatron-core 0.16.1 (what pip installs on Python 3.10/3.11: later releases need
3.12), 0.17, 0.18 and 0.19.x, and Megatron-LM at Primus's pin (``d3528a2``, a commit of March 2026 that calls
itself ``0.16.0rc0``). The MoE expert API changed in two steps; each step is detected by the name it added,
not by the version number (the pin and 0.16.1 share one, yet differ):

==============  ============================  ===============================  ============================
version         ``MoELayer`` makes experts    ``TEGroupedMLP`` makes fc1/fc2   grouped submodules class
==============  ============================  ===============================  ============================
0.16.x          ``build_module(ModuleSpec)``  ``build_module(ModuleSpec)``     ``MLPSubmodules``
Primus's pin    ``build_module(ModuleSpec)``  calls the builder                ``TEGroupedMLPSubmodules``
0.17 - 0.19     calls the builder             calls the builder                ``GroupedMLPSubmodules``
==============  ============================  ===============================  ============================

``BackendSpecProvider.grouped_mlp_modules`` follows the first column: ``(class, submodules)`` where
``MoELayer`` builds from a ``ModuleSpec``, an experts builder where it calls one (0.16.x also passes a
second argument, ``moe_use_legacy_grouped_gemm``).

A name the plugin needs that the installed Megatron lacks raises ``MegatronVersionError`` (an
``ImportError``) naming the installed version and the supported range.
"""

from __future__ import annotations

import re
from functools import partial

SUPPORTED = "megatron-core 0.16.1 to 0.19.x, or Megatron-LM at Primus's pin (d3528a2, 0.16.0rc0) or later"
OLDEST = (0, 16)
INSTALL_HINT = "pip install 'megatron-core>=0.16.1' (on Python 3.10/3.11 pip installs 0.16.1)"


class MegatronVersionError(ImportError):
    """The installed Megatron-core is absent or lacks what the plugin needs (the message says which, the
    installed version and the supported range)."""


def _installed():
    try:
        import megatron.core as core
    except ImportError as err:
        raise MegatronVersionError(f"primus_fp8_plugin.megatron needs megatron-core, which does not import here "
                                   f"({type(err).__name__}: {err}); supported: {SUPPORTED}; "
                                   f"{INSTALL_HINT}") from err  # fmt: skip
    return core


def megatron_version() -> str:
    """The installed Megatron-core's version string with its location, e.g. ``0.16.1 (/venv/.../megatron/core)``."""
    import os

    core = _installed()
    return f"{getattr(core, '__version__', 'unknown')} ({os.path.dirname(core.__file__)})"


def version_error(what: str) -> MegatronVersionError:
    """The error for a name ``what`` (e.g. ``megatron.core.transformer.moe.experts.TEGroupedMLP``) the installed
    Megatron-core lacks."""
    return MegatronVersionError(f"primus_fp8_plugin.megatron needs {what}, which megatron-core {megatron_version()} "
                                f"lacks; supported: {SUPPORTED}; {INSTALL_HINT}")  # fmt: skip


def explain_import_error(err: ImportError) -> ImportError:
    """``err`` (an import of the plugin's Megatron modules that failed) as a ``MegatronVersionError`` naming
    the installed version and the supported range; a ``MegatronVersionError`` already does."""
    if isinstance(err, MegatronVersionError):
        return err
    return MegatronVersionError(f"primus_fp8_plugin.megatron does not import with megatron-core {megatron_version()}: "
                                f"{type(err).__name__}: {err}; supported: {SUPPORTED}; {INSTALL_HINT}")  # fmt: skip


def _check_oldest() -> None:
    version = getattr(_installed(), "__version__", "")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) < OLDEST:
        raise MegatronVersionError(f"primus_fp8_plugin.megatron does not support megatron-core {megatron_version()}; "
                                   f"supported: {SUPPORTED}; {INSTALL_HINT}")  # fmt: skip


_check_oldest()

from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402 - after the version check
from megatron.core.transformer.moe import experts as _experts  # noqa: E402
from megatron.core.transformer.moe import moe_layer as _moe_layer  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

# MoELayer calls MoESubmodules.experts as a builder (0.17 on) instead of build_module(ModuleSpec)
EXPERTS_ARE_BUILDERS = hasattr(_moe_layer, "ExpertsBuilder")
# TEGroupedMLP calls its linear_fc1 / linear_fc2 builders (Primus's pin, 0.17 on) instead of build_module
GROUPED_LINEARS_ARE_BUILDERS = hasattr(_experts, "GroupedLinearFc1Builder")

if hasattr(_experts, "GroupedMLPSubmodules"):
    GroupedMLPSubmodules = _experts.GroupedMLPSubmodules
elif hasattr(_experts, "TEGroupedMLPSubmodules"):
    GroupedMLPSubmodules = _experts.TEGroupedMLPSubmodules
elif not GROUPED_LINEARS_ARE_BUILDERS:
    GroupedMLPSubmodules = MLPSubmodules
else:
    raise version_error("megatron.core.transformer.moe.experts.GroupedMLPSubmodules (TEGroupedMLPSubmodules before 0.17)")


def grouped_linear(cls: type, **params):
    """``TEGroupedMLPSubmodules.linear_fc1`` / ``linear_fc2`` entry for the grouped linear ``cls`` with
    constructor keywords ``params``: a builder (``partial``) or, where TEGroupedMLP uses ``build_module``,
    a ``ModuleSpec``."""
    return partial(cls, **params) if GROUPED_LINEARS_ARE_BUILDERS else ModuleSpec(module=cls, params=params)


class ExpertsFromBuilder:
    """For a ``MoELayer`` that makes its experts with ``build_module`` (before 0.17): ``build_module`` calls a
    class, so this one's construction returns ``builder(num_local_experts, config, pg_collection=...)`` itself:
    Megatron's own experts module (``TEGroupedMLP``, ``SequentialMLP``), not a wrapper. ``builder`` is a
    0.17-style experts builder that decides when the layer is built (e.g. ``Fp8Experts`` by
    ``config.moe_grouped_gemm``)."""

    def __new__(cls, num_local_experts, config, *, builder, pg_collection=None, **kwargs):
        return builder(num_local_experts, config, pg_collection=pg_collection, **kwargs)


def moe_experts(builder):
    """The ``MoESubmodules.experts`` entry for a 0.17-style experts ``builder`` (a callable
    ``(num_local_experts, config, *, pg_collection, ...)``, e.g. ``partial(TEGroupedMLP, submodules=...)``):
    the builder itself, or the ``ModuleSpec`` an older ``MoELayer`` builds (a ``partial`` of a class becomes
    Megatron's own form, ``ModuleSpec(module=TEGroupedMLP, submodules=...)``)."""
    if EXPERTS_ARE_BUILDERS:
        return builder
    if isinstance(builder, partial) and isinstance(builder.func, type) and not builder.args:
        kw = dict(builder.keywords)
        return ModuleSpec(module=builder.func, submodules=kw.pop("submodules", None), params=kw)
    return ModuleSpec(module=ExpertsFromBuilder, params={"builder": builder})


def provider_experts(builder):
    """What ``BackendSpecProvider.grouped_mlp_modules`` returns for the experts ``builder`` (a ``partial`` of
    the experts class with ``submodules``): the builder, or ``(class, submodules)`` where ``MoELayer`` builds
    from a ``ModuleSpec``."""
    if EXPERTS_ARE_BUILDERS:
        return builder
    return builder.func, builder.keywords.get("submodules")


def define_te_free_moe_router() -> None:
    """megatron-core 0.16.x and Primus's pin define ``moe_utils.te_general_gemm`` only where Transformer Engine
    imports, yet their router reads it on every forward (``NameError`` without TE); 0.17 sets it to None there,
    which sends the router through its torch path. Define it as 0.17 does (idempotent; nothing to do on 0.17 on)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
