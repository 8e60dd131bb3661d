"""No host synchronisation in the fast spec's layers, checked on the CPU.

A call that reads a device value on the host (``.item()``, ``bool(t)`` in an ``if``, ``.tolist()``,
``nonzero``, ``.cpu()``, ...) stalls the GPU every step and makes the layer uncapturable in a CUDA graph
(Megatron's ``--cuda-graph-impl local``). Here a ``TorchFunctionMode`` records every such call whose
caller is the plugin's own code while Megatron's ``TransformerBlock`` of ``fp8_gpt_fast_layer_spec``
layers runs a forward and a backward (the weight cache refreshing, then serving; with and without
Megatron's gradient-accumulation fusion into ``main_grad``), on the ``triton`` backend (the GPU's
kernels, through Triton's interpreter: the interpreter's own host reads are not the plugin's and are
not counted) and on ``reference``. On the GPU, tests/gpu/test_gpu_megatron_cuda_graph.py runs the same
block under ``torch.cuda.set_sync_debug_mode("error")`` and under Megatron's CUDA graphs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import primus_fp8_plugin

from .common import tiny_config

pytestmark = pytest.mark.usefixtures("megatron_world")

PLUGIN = str(Path(primus_fp8_plugin.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
INTERPRETER_ONLY = ("interpreter_fix.py",)  # runs only under TRITON_INTERPRET=1, never on a GPU
# (file, function) whose host read is the CPU branch of a check that a GPU makes device-side
# (``torch._assert_async``; tests/gpu/test_gpu_counts.py runs it under set_sync_debug_mode("error"))
CPU_BRANCH_ONLY = {("grouped_tensor.py", "_device_layout")}

# Tensor methods and torch functions that hand a device value to the host (a device synchronisation)
HOST_READS = {"__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "cpu",
              "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
              "is_nonzero", "_local_scalar_dense"}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Records ``(function, file:line)`` of every host read whose nearest caller outside torch is the plugin (or
    a file under one of ``roots``, e.g. Megatron's MoE code)."""

    def __init__(self, roots: tuple[str, ...] = ()):
        super().__init__()
        self.roots = (PLUGIN, *roots)
        self.found: list[tuple[str, str]] = []
        self.plugin_calls = 0  # torch calls made from the watched code (the mode saw the layers at all)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH):
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else ""
        cpu_branch = (Path(where).name, frame.f_code.co_name if frame is not None else "") in CPU_BRANCH_ONLY
        if where.startswith(self.roots) and not where.endswith(INTERPRETER_ONLY) and not cpu_branch:
            self.plugin_calls += 1
            name = getattr(func, "__name__", str(func))
            repeats = (name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                       and (kwargs or {}).get("output_size") is None)  # fmt: skip  (given: no read)
            if name in HOST_READS or repeats:
                self.found.append((name, f"{where}:{frame.f_lineno}"))
        return func(*args, **(kwargs or {}))


MODELS = {
    "llama": dict(num_layers=1, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, num_query_groups=2),
    "gpt": dict(num_layers=1, normalization="LayerNorm"),
}  # fmt: skip


@pytest.mark.parametrize("fusion", [False, True], ids=["plain_wgrad", "main_grad_fusion"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_fast_spec_block_reads_no_device_value_on_the_host(model, backend, fusion):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from primus_fp8_plugin import backend_availability
    from primus_fp8_plugin.megatron import TorchNorm
    from primus_fp8_plugin.megatron.fast_specs import get_gpt_fast_layer_spec, spec_options
    from primus_fp8_plugin.megatron.layers import Fp8MegatronLinear

    if not backend_availability(backend, "cpu"):
        pytest.skip(backend_availability(backend, "cpu").reason)
    cfg = tiny_config(**MODELS[model], gradient_accumulation_fusion=fusion)
    layer = get_gpt_fast_layer_spec(**spec_options(cfg), backend=backend)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=[layer], layer_norm=TorchNorm))
    fp8 = [m for m in block.modules() if isinstance(m, Fp8MegatronLinear)]
    assert fp8 and all(m.fp8_backend == backend for m in fp8)
    if fusion:  # Megatron's DDP gives every parameter an fp32 main_grad
        for p in block.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(32) if model == "llama" else None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 2, cfg.hidden_size, generator=g).to(torch.bfloat16)
    dy = torch.randn(32, 2, cfg.hidden_size, generator=g).to(torch.bfloat16)

    def fwd_bwd(refresh: bool):
        for m in fp8:
            m.is_first_microbatch = refresh
        xin = x.clone().requires_grad_(True)
        block(hidden_states=xin, attention_mask=None, rotary_pos_emb=rope).backward(dy)
        return xin.grad

    reads = HostReads()
    with reads:
        fwd_bwd(True)  # the weight cache quantizes
        fwd_bwd(False)  # and serves its copy
    assert reads.plugin_calls > 50, f"the mode saw only {reads.plugin_calls} torch calls from the plugin"
    assert all(m.weight_cache.refreshes == 1 for m in fp8)  # the second pass was served from the cache
    if fusion:
        assert all(bool(m.weight.main_grad.abs().sum() > 0) and m.weight.grad is None for m in fp8)
    assert not reads.found, f"host reads of device values in the plugin's layers: {sorted(set(reads.found))}"
