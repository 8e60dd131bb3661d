"""FP8 primary weights (``fp8_params.py``) for a model wrapped in Megatron-core's ``DistributedDataParallel``, driven
by the training loop (``attach``, as the plugin's trainer does) or, in a loop the plugin does not own (Megatron-LM's
``pretrain_gpt.py``), by hooks (``PRIMUS_FP8_PARAMS=1``).

Under the distributed optimizer DDP makes every trainable parameter a view of a param buffer (one per dtype and
expert group: ``buffers``, ``expert_parallel_buffers``, each with its ``param_data`` and ``params``), into which the
optimizer writes its shard of bf16(master) and which it all-gathers; ``Fp8Params`` frees and re-makes those buffers
as a whole. Without the distributed optimizer the parameters keep their own storage.

The hooks (``install_hooks``, when a plugin layer is built with ``PRIMUS_FP8_PARAMS=1``): a forward pre-hook releases
the weights of a DDP model whenever it runs a training forward (grad mode on, ``model.training``; the first call of a
step does it, later microbatches find them released), attaching ``Fp8Params`` to it the first time; torch's global
optimizer step pre-hook restores them before any optimizer steps (Megatron's optimizers step their inner
``torch.optim`` optimizer before they write bf16(master) into the model), and refuses (NotImplementedError) a step
before any DDP model trained: the variable asked for something no model got (FSDP, a model outside Megatron's DDP).
Until that first step the forward pre-hook is torch's global module hook (the DDP models are not known before they
run); the step moves it onto each DDP model that trained and removes the global one, whose presence sends every
module call in the process through torch's slower hook path (~1.3 us a call on a CPU). A layer built later installs
the global hook again until the next step. So a DDP model whose first training forward comes after an optimizer
step and after the last plugin layer was built (a second model trained later in the process) is not released: it
trains on BF16 weights and the weight cache, the same numerics, without the memory saving. Evaluation (no grad)
and checkpoints, between a step and the next training forward, see the bf16 weights.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..fp8_params import Fp8Params

ATTACHED = "primus_fp8_params"  # the attribute holding a model's Fp8Params


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
    """The ``Fp8Params`` of ``model`` (Megatron's DDP wrapper, or a module of the plugin's layers): made the first
    time, the same object afterwards.

    Raises NotImplementedError where DDP gathers parameters in the forward pass (``overlap_param_gather``: the
    gather would write into a buffer ``release`` freed) or where Megatron-FSDP owns the parameters."""
    existing = getattr(model, ATTACHED, None)
    if existing is not None:
        return existing
    config = getattr(model, "ddp_config", None)
    if config is not None and getattr(config, "overlap_param_gather", False):
        raise NotImplementedError("FP8 primary weights with overlap_param_gather: DDP then all-gathers the parameters "
                                  "in the next forward's pre-hooks, into the buffer they free; turn overlap_param_gather "
                                  "off")  # fmt: skip
    if config is not None and getattr(config, "use_megatron_fsdp", False):
        raise NotImplementedError("FP8 primary weights under Megatron-FSDP: it owns the parameters' storage")
    primary = Fp8Params(model, shared_storages=ddp_param_buffers(model))
    setattr(model, ATTACHED, primary)
    return primary


_hooked: weakref.WeakSet = weakref.WeakSet()  # DDP models the hooks attached Fp8Params to
_on_model: weakref.WeakSet = weakref.WeakSet()  # DDP models holding the forward pre-hook themselves
_step_hook: list = []  # the optimizer step pre-hook's handle
_global_hook: list = []  # the global module forward pre-hook's handle, until the first step after it
_model_hooks: list = []  # the per-model forward pre-hooks' handles


def install_hooks() -> None:
    """Drive FP8 primary weights by hooks (module docstring): the optimizer step hook once per process, the global
    module forward hook until the next optimizer step."""
    if not _step_hook:
        _step_hook.append(register_optimizer_step_pre_hook(restore_before_optimizer_step))
    if not _global_hook:
        _global_hook.append(register_module_forward_pre_hook(release_before_training_forward))


def remove_hooks() -> None:
    """Remove the hooks (the models they attached keep their ``Fp8Params``: restore them before another step)."""
    for handles in (_step_hook, _global_hook, _model_hooks):
        while handles:
            handles.pop().remove()
    _on_model.clear()


def release_before_training_forward(module: nn.Module, args) -> None:
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and module.training and torch.is_grad_enabled():
        attach(module).release()
        _hooked.add(module)


def restore_before_optimizer_step(optimizer, args, kwargs) -> None:
    if not _hooked:
        raise NotImplementedError(
            "PRIMUS_FP8_PARAMS=1, but no Megatron-core DistributedDataParallel model ran a training forward before "
            f"this optimizer step ({type(optimizer).__name__}): FP8 primary weights are held for a model wrapped in "
            "Megatron's DDP (not FSDP); unset PRIMUS_FP8_PARAMS to train with BF16 weights and the weight cache"
        )
    for model in list(_hooked):
        getattr(model, ATTACHED).restore()
        if model not in _on_model:  # from now on the model's own hook releases its weights
            _model_hooks.append(model.register_forward_pre_hook(release_before_training_forward, prepend=True))
            _on_model.add(model)
    while _global_hook:  # every DDP model that trained in this step ran its forward before it
        _global_hook.pop().remove()
