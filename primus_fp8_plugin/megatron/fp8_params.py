"""FP8 primary weights (``fp8_params.py``) for a model wrapped in Megatron-core's ``DistributedDataParallel``.

Under the distributed optimizer DDP makes every trainable parameter a view of a param buffer (one per dtype and
expert group: ``buffers``, ``expert_parallel_buffers``, each with its ``param_data`` and ``params``), into which the
optimizer writes its shard of bf16(master) and which it all-gathers; ``Fp8Params`` frees and re-makes those buffers
as a whole. Without the distributed optimizer the parameters keep their own storage.
"""

from __future__ import annotations

from torch import nn

from ..fp8_params import Fp8Params


def ddp_param_buffers(model: nn.Module) -> list[tuple]:
    """``(param_data, params)`` of each DDP param buffer that holds parameter data (the distributed optimizer's);
    empty for another module or without the distributed optimizer."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        buffers = getattr(model, name, None)
        if not isinstance(buffers, list):  # a plain module's ``buffers`` is nn.Module's method
            continue
        found += [(b.param_data, list(b.params)) for b in buffers if getattr(b, "param_data", None) is not None]
    return found


def attach(model: nn.Module) -> Fp8Params:
    """``Fp8Params`` for ``model`` (Megatron's DDP wrapper, or a module of the plugin's layers).

    Raises NotImplementedError where DDP gathers parameters in the forward pass (``overlap_param_gather``: the
    gather would write into a buffer ``release`` freed) or where Megatron-FSDP owns the parameters."""
    config = getattr(model, "ddp_config", None)
    if config is not None and getattr(config, "overlap_param_gather", False):
        raise NotImplementedError("FP8 primary weights with overlap_param_gather: DDP then all-gathers the parameters "
                                  "in the next forward's pre-hooks, into the buffer they free; turn overlap_param_gather "
                                  "off")  # fmt: skip
    if config is not None and getattr(config, "use_megatron_fsdp", False):
        raise NotImplementedError("FP8 primary weights under Megatron-FSDP: it owns the parameters' storage")
    return Fp8Params(model, shared_storages=ddp_param_buffers(model))
