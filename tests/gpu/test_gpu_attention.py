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
