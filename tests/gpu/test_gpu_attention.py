"""SdpaAttention on the GPU: PyTorch's fused kernels accept it (flash for causal without a mask,
memory-efficient with a padding mask; grouped-query attention too), and it matches Megatron's unfused
DotProductAttention within bf16 rounding (outputs and q/k/v gradients)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")


def _config(heads, groups, head_dim):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=groups,
        bf16=True, params_dtype=torch.bfloat16, masked_softmax_fusion=False, attention_dropout=0.0,
    )  # fmt: skip


def _padding_causal_mask(s, b):
    """Megatron's convention (True = masked out): causal, and sequences of decreasing length."""
    lens = torch.linspace(s, s // 3, b, device="cuda").long()
    pad = torch.arange(s, device="cuda") >= lens[:, None]
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
    return (pad[:, None, :, None] | pad[:, None, None, :]) | causal


def _fwd_bwd(module, q, k, v, dy, mask, mask_type):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*inputs, mask, attn_mask_type=mask_type)
    out.backward(dy)
    return [out.float()] + [t.grad.float() for t in inputs]


def _ulps(got, ref):
    """Largest difference in units of a bf16 ulp at the reference's largest magnitude."""
    return ((got - ref).abs().max() / 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)).item()


@pytest.mark.parametrize("heads, groups", [(16, 16), (16, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_attention_uses_fused_kernels_and_matches_megatron(nccl_world, heads, groups, masked):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    s, b, head_dim = 1024, 2, 128
    g = torch.Generator(device="cuda").manual_seed(heads + groups + masked)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, dy = rand(s, b, heads, head_dim), rand(s, b, heads * head_dim)
    k, v = rand(s, b, groups, head_dim), rand(s, b, groups, head_dim)
    mask = _padding_causal_mask(s, b) if masked else None
    causal = AttnMaskType.causal
    cfg = _config(heads, groups, head_dim)
    kernel = SDPBackend.EFFICIENT_ATTENTION if masked else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([kernel]):  # only this kernel allowed: raises if SdpaAttention's call is not eligible
        ours = _fwd_bwd(SdpaAttention(cfg, 1, causal, "self"), q, k, v, dy, mask, causal)
    ref = _fwd_bwd(DotProductAttention(cfg, 1, causal, "self"), q, k, v, dy, mask, causal)
    errors = [_ulps(a, r) for a, r in zip(ours, ref, strict=True)]
    print(f"heads {heads} groups {groups} masked {masked} ({kernel.name}): ulps out, dq, dk, dv = {errors}")
    assert all(math.isfinite(e) and e <= 8 for e in errors), errors


@pytest.mark.parametrize("kernels", ["flash", "cudnn,flash,efficient", ""])
def test_kernel_order_output_marking_and_cuda_graph_replay(nccl_world, monkeypatch, kernels):
    """With ``PRIMUS_FP8_SDPA_KERNELS`` (PyTorch's flash kernel, cuDNN's first, or unset: cuDNN's first on Hopper),
    grouped-query causal attention at Llama-3-8B's head shape: the output is a view of what SDPA's node saves and
    is marked for the FP8 output projection, the node is the expected kernel's, and a CUDA graph of
    forward+backward replays eager's forward bits and its gradients within 2 bf16 ulps (backward kernels may
    accumulate in another order)."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import KERNELS_ENV, SdpaAttention
    from primus_fp8_plugin.ops.api import SAVED_ELSEWHERE

    monkeypatch.setenv(KERNELS_ENV, kernels)
    s, b, heads, groups, hd = 1024, 2, 32, 8, 128
    module = SdpaAttention(_config(heads, groups, hd), 1, AttnMaskType.causal, "self")
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(s, b, heads, hd, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(s, b, groups, hd, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dy = torch.randn(s, b, heads * hd, generator=g, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        out.backward(dy)
        return out

    out = step()
    fn = out.grad_fn  # back through the reshape and permute to SDPA's node
    while fn is not None and not type(fn).__name__.startswith("ScaledDotProduct"):
        fn = fn.next_functions[0][0]
    hopper = torch.cuda.get_device_capability()[0] == 9
    expected = "Cudnn" if kernels.startswith("cudnn") or (not kernels and hopper) else "Flash"
    print(f"{kernels}: {type(fn).__name__}, marked {getattr(out, SAVED_ELSEWHERE, False)}")
    assert fn is not None and expected in type(fn).__name__
    assert getattr(out, SAVED_ELSEWHERE, False), "SDPA's output is not marked for the projection"
    eager = [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]
    del out, fn  # a live eager graph keeps the leaves' AccumulateGrad nodes on the default stream: capture fails
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out.detach()] + [t.grad for t in (q, k, v)]
    assert torch.equal(replayed[0], eager[0]), "the forward replays bit for bit"
    errors = [_ulps(a.float(), r.float()) for a, r in zip(replayed[1:], eager[1:], strict=True)]
    assert all(e <= 2 for e in errors), errors  # backward kernels may accumulate in another order
