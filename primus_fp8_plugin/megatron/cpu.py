"""Running Megatron-core on a CPU (tests, the CPU demo): the stand-ins it needs, and gloo set-up.

Megatron-core assumes CUDA in a few places that have nothing to do with the math. What makes
GPTModel forward/backward and distributed checkpointing run on a CPU with gloo:
``torch.cuda.current_device`` answering "cpu", the CUDA RNG tracker's ``fork`` as a null context,
``torch.cuda.synchronize`` as a no-op, streams that order nothing, ``use_cpu_initialization=True``, fusions off, and no
``model_parallel_cuda_manual_seed``; and (seen with 0.19.2) the default causal attention mask,
which Megatron allocates on "cuda" (docs/MEGATRON.md, "CPU contract"). Only call this where there is
no GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_installed = False

# Megatron's fused kernels (and its gradient-accumulation fusion in its own linears) need apex or TE:
# off in every config this package builds without them (CPU runs, the trainer, tools/te_compare.py). The
# plugin's layers fuse wgrad accumulation themselves, but read the same config flag.
FUSIONS_OFF = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
)


def install_cpu_standins() -> None:
    """Patch the CUDA-only calls Megatron-core makes outside the math (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_standins() is for machines without a GPU")
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as tf_utils

    from .compat import define_te_free_moe_router

    def causal_mask_on_cpu(sq: int) -> torch.Tensor:  # Megatron builds its default mask on "cuda"
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tf_utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = causal_mask_on_cpu
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()  # DDP's gradient sync waits on it
    torch.cuda.Stream = lambda *a, **k: _CpuStream()  # Megatron's alltoall token dispatcher makes one
    mp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    define_te_free_moe_router()  # megatron-core 0.16's MoE router without TE (compat.py)
    _installed = True


class _CpuStream:
    """What Megatron's gradient sync asks of ``torch.cuda.current_stream()``; CPU work is in order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaAsCpu(TorchFunctionMode):
    """Runs code that hard-codes CUDA (Megatron's optimizers: ``device='cuda'`` buffers,
    ``tensor.cuda()``, ``param.type() == 'torch.cuda.FloatTensor'`` checks) on CPU tensors: device
    arguments naming CUDA become the CPU, ``.cuda()`` is the identity, and ``Tensor.type()`` reports
    the CUDA type name. For CPU training runs only (a Python hook on every torch call)."""

    @staticmethod
    def _cpu(dev):
        if dev is None:
            return dev
        d = dev if isinstance(dev, torch.device) else torch.device(dev) if isinstance(dev, (str, int)) else None
        return torch.device("cpu") if d is not None and d.type == "cuda" else dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], self._cpu(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def init_cpu_distributed(
    rank: int = 0, world_size: int = 1, tp: int = 1, port: int | None = None, ep: int = 1, etp: int | None = None
) -> None:
    """gloo process group + Megatron's model-parallel groups (TP = ``tp``, expert parallelism ``ep``, expert TP
    ``etp``, default ``tp``) on this CPU process."""
    from megatron.core import parallel_state

    install_cpu_standins()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port is not None:  # an explicit port wins over one inherited from a parent process
            os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )


def cpu_transformer_config(**overrides):
    """A ``TransformerConfig`` with what a CPU run needs (CPU init, fusions off); ``overrides`` win."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, **FUSIONS_OFF)
    kw.update(overrides)
    return TransformerConfig(**kw)
