"""``Fp8FastSelfAttention``: Megatron's ``SelfAttention`` whose rotary embedding is the plugin's (``rope.py``:
Megatron's unfused sbhd RoPE bit for bit, one kernel each way on the triton backend, no apex or TE).

Megatron's ``Attention.forward`` gets the query, key and value from ``get_query_key_value_tensors`` (a public
method: the QKV projection, the split into heads, the q/k norms) and then rotates query and key when it is given
``rotary_pos_emb``. For the calls the plugin's RoPE computes (sbhd layout: no packed sequences; no inference
context; no MLA, mRoPE, YaRN scaling or fused single-QKV RoPE), this module's ``forward`` hands Megatron's forward
no ``rotary_pos_emb`` and rotates query and key itself in its ``get_query_key_value_tensors``, right where
Megatron would have. Every other call is Megatron's, unchanged. Nothing of Megatron is replaced: both are methods
of this subclass. ``rope_calls`` counts the rotated tensors.

Under full-layer activation recomputation the forward runs again, and so does the rotation; selective
recomputation of core attention starts after it.
"""

from __future__ import annotations

import contextvars

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_rope
from megatron.core.transformer.attention import SelfAttention

from ..rope import apply_rotary_pos_emb as plugin_rope

# the (query angles, key angles) of the forward running now, for its get_query_key_value_tensors
_PENDING: contextvars.ContextVar = contextvars.ContextVar("primus_fp8_pending_rope", default=None)


class Fp8FastSelfAttention(SelfAttention):
    """``SelfAttention`` (same constructor and submodules) with the plugin's RoPE; extra keyword
    ``rope_backend`` (a backend name or ``"auto"``, as the linears' ``fp8_backend``)."""

    def __init__(self, *args, rope_backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.rope_backend = rope_backend
        self.rope_calls = 0

    def _rotates(self, kwargs: dict) -> bool:
        """Whether this call's RoPE is the plugin's (the module docstring's conditions)."""
        config = self.config
        return (
            kwargs.get("rotary_pos_emb") is not None
            and kwargs.get("packed_seq_params") is None
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and kwargs.get("key_value_states") is None
            and not getattr(config, "multi_latent_attention", False)
            and getattr(config, "mrope_section", None) is None
            and not getattr(config, "fused_single_qkv_rope", False)
            and not getattr(config, "flash_decode", False)
            and getattr(self, "_yarn_concentration_factor", 1.0) == 1.0
        )

    def forward(self, *args, **kwargs):
        if len(args) > 4 or not self._rotates(kwargs):  # rotary_pos_emb given by position: Megatron's own path
            return super().forward(*args, **kwargs)
        emb = kwargs["rotary_pos_emb"]
        token = _PENDING.set(emb if isinstance(emb, tuple) else (emb, emb))
        try:
            return super().forward(*args, **{**kwargs, "rotary_pos_emb": None})
        finally:
            _PENDING.reset(token)

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        pending = _PENDING.get()
        if pending is None:
            return qkv
        query, key, *rest = qkv
        q_emb, k_emb = pending
        return (self._rotate(query, q_emb), self._rotate(key, k_emb), *rest)

    def _rotate(self, t, freqs):
        """``t`` [s, b, h, d] rotated by ``freqs`` [s, 1 or b, 1, rot]: the plugin's RoPE where it computes the call
        (angles for every position of ``t``), else Megatron's."""
        if freqs is None:
            return t
        if t.dim() != 4 or freqs.dim() != 4 or freqs.shape[0] != t.shape[0]:
            return megatron_rope(t, freqs, config=self.config)
        self.rope_calls += 1
        interleaved = bool(getattr(self.config, "rotary_interleaved", False))
        return plugin_rope(t, freqs.detach(), rotary_interleaved=interleaved, backend=self.rope_backend)
