"""RoPE without apex: ``primus_fp8_plugin.rope.apply_rotary_pos_emb`` is Megatron's unfused
``_apply_rotary_pos_emb_bshd`` bit for bit, forward and (through torch's autograd of Megatron's) backward,
on every CPU backend."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import available_backends
from primus_fp8_plugin.rope import apply_rotary_pos_emb

rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

CPU_BACKENDS = [n for n, a in available_backends("cpu").items() if a]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def rotary_freqs(s, rot, interleaved, batch=1, seed=0):
    """Megatron's RotaryEmbedding angles (cat or interleave of the half-dim frequencies), perturbed so that
    the two halves differ (the kernel must not assume they are equal)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.repeat_interleave(f, 2, -1) if interleaved else torch.cat((f, f), -1)
    g = torch.Generator().manual_seed(seed)
    return (emb[:, None, None, :] + 0.01 * torch.randn(s, batch, 1, rot, generator=g)).contiguous()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "dtype, s, b, nh, d, rot, interleaved, mscale, freq_batch",
    [
        (torch.bfloat16, 7, 2, 3, 64, 64, False, 1.0, 1),
        (torch.bfloat16, 5, 1, 4, 96, 64, True, 1.0, 1),  # partial rotary dim: features 64..95 pass through
        (torch.float32, 6, 3, 2, 32, 32, True, 1.3, 3),  # per-batch angles, mscale
        (torch.float16, 4, 2, 5, 48, 16, False, 0.7, 1),
    ],
)
def test_rope_is_megatrons_unfused_rope_bit_for_bit(backend, dtype, s, b, nh, d, rot, interleaved, mscale, freq_batch):
    g = torch.Generator().manual_seed(s * d)
    qkv = torch.randn(s, b, nh, 3 * d, generator=g).to(dtype)
    t = qkv[..., :d]  # strided, as the query split from Megatron's fused QKV projection
    t[0, 0, 0] = -0.0  # signed zeros in and out
    freqs = rotary_freqs(s, rot, interleaved, freq_batch, seed=d)
    dy = torch.randn(s, b, nh, d, generator=g).to(dtype)
    dy[1, 0, 0] = -0.0
    dy[2, 0, 0] *= -0.0
    ours_t, theirs_t = t.detach().clone().requires_grad_(True), t.detach().clone().requires_grad_(True)
    ours = apply_rotary_pos_emb(ours_t, freqs, rotary_interleaved=interleaved, mscale=mscale, backend=backend)
    theirs = rope_utils._apply_rotary_pos_emb_bshd(theirs_t, freqs, rotary_interleaved=interleaved, mscale=mscale)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(bits(ours), bits(theirs))
    ours.backward(dy)
    theirs.backward(dy)
    assert torch.equal(bits(ours_t.grad), bits(theirs_t.grad))
    assert ours_t.grad.abs().sum() > 0


def test_rope_rejects_what_it_does_not_compute():
    t = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="even"):
        apply_rotary_pos_emb(t, torch.randn(4, 1, 1, 5))
    with pytest.raises(ValueError, match=r"\[s, 1 or b, 1, rot\]"):
        apply_rotary_pos_emb(t, torch.randn(3, 1, 1, 8))
    with pytest.raises(NotImplementedError, match="freqs.detach"):
        apply_rotary_pos_emb(t, torch.randn(4, 1, 1, 8, requires_grad=True))
