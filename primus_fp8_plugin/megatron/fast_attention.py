"""``Fp8FastSelfAttention``: Megatron's ``SelfAttention`` whose rotary embedding is the plugin's (``rope.py``:
Megatron's unfused sbhd RoPE bit for bit, one kernel each way on the triton backend, no apex or TE).

Megatron's ``Attention.forward`` applies RoPE through the module-level name ``apply_rotary_pos_emb`` of
``megatron.core.transformer.attention`` (rope_utils' router). Building an ``Fp8FastSelfAttention`` wraps that
name once with a router that sends a call to the plugin's RoPE only while an ``Fp8FastSelfAttention``'s
forward runs (a context variable marks it) and only for what the plugin's RoPE computes: the sbhd layout
(no packed ``cu_seqlens``, angles for every position of ``t``), no MLA interleaving, no mRoPE. Every other
call (other attention modules, other layouts) goes to Megatron's function unchanged.
``Fp8FastSelfAttention.rope_calls`` counts the routed calls.
"""

from __future__ import annotations

import contextvars

from megatron.core.transformer.attention import SelfAttention

from ..rope import apply_rotary_pos_emb as plugin_rope

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("primus_fp8_fast_attention", default=None)


def _routes_to_plugin(t, freqs, config, cu_seqlens, mla_rotary_interleaved) -> bool:
    return (
        cu_seqlens is None
        and t.dim() == 4
        and freqs.dim() == 4
        and freqs.shape[0] == t.shape[0]
        and not mla_rotary_interleaved
        and not getattr(config, "multi_latent_attention", False)
        and getattr(config, "mrope_section", None) is None
    )


def _install_rope_router() -> None:
    """Wrap ``megatron.core.transformer.attention.apply_rotary_pos_emb`` (idempotent)."""
    from megatron.core.transformer import attention as mattn

    original = mattn.apply_rotary_pos_emb
    if getattr(original, "_primus_fp8_router", False):
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
        # kwargs go on as given: mla_rotary_interleaved exists from megatron-core 0.19 on
        layer = _ACTIVE.get()
        mla = kwargs.get("mla_rotary_interleaved", False)
        if layer is None or set(kwargs) - {"mla_rotary_interleaved"} or not _routes_to_plugin(t, freqs, config, cu_seqlens, mla):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)
        layer.rope_calls += 1
        return plugin_rope(t, freqs.detach(), rotary_interleaved=bool(getattr(config, "rotary_interleaved", False)),
                           mscale=mscale, backend=layer.rope_backend)  # fmt: skip

    apply_rotary_pos_emb._primus_fp8_router = True
    apply_rotary_pos_emb.__wrapped__ = original
    mattn.apply_rotary_pos_emb = apply_rotary_pos_emb


class Fp8FastSelfAttention(SelfAttention):
    """``SelfAttention`` (same constructor and submodules) with the plugin's RoPE; extra keyword
    ``rope_backend`` (a backend name or ``"auto"``, as the linears' ``fp8_backend``)."""

    def __init__(self, *args, rope_backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.rope_backend = rope_backend
        self.rope_calls = 0
        _install_rope_router()

    def forward(self, *args, **kwargs):
        token = _ACTIVE.set(self)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
