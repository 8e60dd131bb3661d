"""The environment variables the package honours: read here and nowhere else, each when the object it configures is
made (a recipe, a weight cache, an attention layer), and passed down from there as arguments.

=====================================  ==========================================================================
variable                               meaning
=====================================  ==========================================================================
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` ``1``: fp32 scales instead of powers of 2 (TE's own switch; a recipe's default)
``PRIMUS_FP8_CHECK_WEIGHT_CACHE``      ``1``: every weight cache compares each copy it serves with a fresh one
``PRIMUS_FP8_SDPA_KERNELS``            the SDPA kernels ``SdpaAttention`` ranks (``megatron/attention.py``)
``PRIMUS_FP8_PARAMS``                  ``1``: FP8 primary weights in a Megatron-LM run (``megatron/fp8_params.py``), read
                                       when the plugin's Megatron layers are built
``PRIMUS_FP8_MOE_ROUTED``              ``0``: the plugin's MoE layers keep Megatron's token dispatcher (``megatron/moe.py``;
                                       for A/B measurements), read when each layer is built
``PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT`` ``1``: the fast spec's grouped experts hold one ``[E, out, in]`` weight per linear
                                       instead of one parameter per expert (``megatron/grouped.py``: its checkpoint
                                       limits), read when the spec is built (``megatron/fast_specs.py``)
``PRIMUS_FP8_KILL_DURING_SAVE``        a test hook: ``STAGE[@STEP]`` makes the trainer's saving process SIGKILL itself
                                       at that stage of a checkpoint save (``training/checkpoint_store.py``)
=====================================  ==========================================================================
"""

from __future__ import annotations

import os

FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
CHECK_WEIGHT_CACHE = "PRIMUS_FP8_CHECK_WEIGHT_CACHE"
SDPA_KERNELS = "PRIMUS_FP8_SDPA_KERNELS"
KILL_DURING_SAVE = "PRIMUS_FP8_KILL_DURING_SAVE"
FP8_PARAMS = "PRIMUS_FP8_PARAMS"
MOE_ROUTED = "PRIMUS_FP8_MOE_ROUTED"
MOE_SINGLE_GROUPED_WEIGHT = "PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT"


def fp32_scales() -> bool:
    """TE's rule: power-of-2 scales unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``."""
    return os.environ.get(FP32_SCALES, "0") == "1"


def check_weight_cache() -> bool:
    return os.environ.get(CHECK_WEIGHT_CACHE, "0") == "1"


def sdpa_kernels() -> str:
    return os.environ.get(SDPA_KERNELS, "")


def kill_during_save() -> str:
    """The save stage (``STAGE`` or ``STAGE@STEP``) at which a checkpoint save kills its process; empty: none."""
    return os.environ.get(KILL_DURING_SAVE, "")


def fp8_params() -> bool:
    return os.environ.get(FP8_PARAMS, "0") == "1"


def moe_routed() -> bool:
    return os.environ.get(MOE_ROUTED, "1") != "0"


def moe_single_grouped_weight() -> bool:
    return os.environ.get(MOE_SINGLE_GROUPED_WEIGHT, "0") == "1"
