"""A TE-free fused core attention for Megatron-core specs: ``SdpaAttention``.

Megatron's local GPT spec puts ``DotProductAttention`` in ``core_attention``. That module is unfused: it
materialises the ``[b * np, sq, sk]`` score matrix (and its softmax, and the dropout mask) in global memory,
which is slow and memory hungry. Transformer Engine's spec uses a fused flash attention instead, so a local
spec compared against TE's would be handicapped by attention alone. ``SdpaAttention`` is a drop-in for
``DotProductAttention`` (``ModuleSpec(module=SdpaAttention)`` in ``SelfAttentionSubmodules(core_attention=...)``)
built on ``torch.nn.functional.scaled_dot_product_attention``, which dispatches to cuDNN's, the flash or the
memory-efficient kernels on a GPU. Its numerics equal ``DotProductAttention``'s up to bf16 rounding (the fused
kernels keep scores and probabilities in fp32, where Megatron rounds the scores, and the probabilities, to the
input dtype); in fp32 they agree to rounding.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .. import env
from ..ops import mark_saved_elsewhere

_TORCH_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa

KERNELS_ENV = env.SDPA_KERNELS
_KERNEL_NAMES = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}  # fmt: skip


_CUDNN_FIRST = "cudnn,flash,efficient,math"


def kernel_priority(spec: str | None = None, device: torch.device | None = None) -> list | None:
    """The SDPA kernels ``SdpaAttention`` lets PyTorch choose from on ``device``, in priority order, from ``spec``
    (default: the environment variable ``PRIMUS_FP8_SDPA_KERNELS``), a comma-separated list of ``cudnn``,
    ``flash``, ``efficient``, ``math``. ``torch`` means PyTorch's own order (``None``). Unset or empty: cuDNN's
    attention first on NVIDIA Hopper (compute capability 9.x; on the H200 it runs Llama-3-8B's attention 1.7x
    faster than PyTorch's flash kernel, and pretrain_gpt's 8B-width step 5.5% faster, docs/PERFORMANCE.md),
    PyTorch's own order elsewhere (other NVIDIA GPUs: not measured; ROCm has no cuDNN; CPU). PyTorch skips a listed
    kernel that cannot run the call (and says why in a warning if none can). A name outside the list raises
    ``ValueError``."""
    spec = env.sdpa_kernels() if spec is None else spec
    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    if not names:
        return _device_default(device)
    if names == ["torch"]:
        return None
    bad = [n for n in names if n not in _KERNEL_NAMES]
    if bad:
        raise ValueError(f"{KERNELS_ENV}={spec!r}: unknown SDPA kernel(s) {bad}; use 'torch' (PyTorch's own order) or "
                         f"a comma-separated list of {', '.join(_KERNEL_NAMES)}")  # fmt: skip
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, _KERNEL_NAMES[n]) for n in names]


def _device_default(device: torch.device | None) -> list | None:
    if device is None or device.type != "cuda" or torch.version.hip is not None:
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    return kernel_priority(_CUDNN_FIRST)


@functools.cache
def _priority_for(spec: str, device: torch.device) -> tuple | None:
    """``kernel_priority`` once per (setting, device): the forward asks on every call."""
    kernels = kernel_priority(spec, device)
    return None if kernels is None else tuple(kernels)


_ENABLED = {"CUDNN_ATTENTION": "cudnn_sdp_enabled", "FLASH_ATTENTION": "flash_sdp_enabled",
            "EFFICIENT_ATTENTION": "mem_efficient_sdp_enabled", "MATH": "math_sdp_enabled"}  # fmt: skip


def kernel_context(priority, device: torch.device):
    """``sdpa_kernel`` over the kernels of ``priority`` that are enabled now, in that order: an enclosing
    restriction (the caller's own ``sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``) still holds; if it allows
    none of them, the caller's setting is left as it is."""
    if priority is None or device.type != "cuda":
        return contextlib.nullcontext()
    allowed = [k for k in priority if getattr(torch.backends.cuda, _ENABLED[k.name])()]
    if not allowed:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(allowed, set_priority=True)


def own_storage(value: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``value`` copied into storage of its own where it is a view into a larger buffer that none of ``others``
    shares: Megatron splits the fused QKV projection's output ``[s, b, ng, (np/ng + 2) hn]`` into views, and
    after RoPE (new query and key tensors) the value view is all that keeps that buffer alive, so SDPA saving
    it for backward would keep the whole projection output, ``(np + 2 ng) / ng`` times the value's bytes (6x
    at Llama-3-8B's 32 heads / 8 groups). The copy holds the same values; without RoPE (query and key are views
    of the buffer too) nothing is copied, nor where autograd saves nothing (no gradient wanted: inference, KV caches)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (value, *others))):
        return value
    st = value.untyped_storage()
    if st.nbytes() <= value.numel() * value.element_size():
        return value
    if any(t.untyped_storage().data_ptr() == st.data_ptr() for t in others):
        return value
    return value.contiguous() if not value.is_contiguous() else value.clone()


class SdpaAttention(MegatronModule):
    """Core attention (softmax(q k^T * scale + mask) v) through PyTorch's fused SDPA kernels.

    Constructor: the same keywords as Megatron's ``DotProductAttention`` (``config``, ``layer_number``,
    ``attn_mask_type``, ``attention_type``, ``attention_dropout``, ``softmax_scale``, ``cp_comm_type``,
    ``pg_collection``); unknown keywords (other Megatron versions) are accepted and ignored, since every size
    is read from the tensors. There are no parameters.

    ``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)``:

    * ``query``: ``[sq, b, np, hn]``; ``key`` and ``value``: ``[sk, b, ng, hn]`` (``hn_v`` for ``value``),
      ``np`` and ``ng`` the query heads and key/value groups of this tensor-parallel rank (read from the
      shapes; ``np`` a multiple of ``ng``: grouped-query attention). Any one floating dtype (bf16, fp16, fp32).
    * ``attention_mask``: ``None`` or a bool tensor broadcastable to ``[b, np, sq, sk]`` (Megatron's
      ``[b, 1, sq, sk]``), True where a score is *masked out* (Megatron's convention).
    * returns ``[sq, b, np * hn_v]`` in the input dtype (the hidden size of this rank's partition).

    Semantics, as ``DotProductAttention``'s (with ``masked_softmax_fusion=False``):

    * mask type (``attn_mask_type`` of the call, else of the constructor): ``causal`` with no mask is
      ``is_causal=True`` (the flash path; ``sq == 1`` means no mask, as for a KV-cache decode step); a given
      mask is applied as it is whatever the type (``causal``, ``padding``, ``no_mask``, ``arbitrary``).
    * a query row whose keys are all masked gets the mean of the values: Megatron fills masked scores with
      -10000, so such a row's softmax is uniform (SDPA alone would give 0 or NaN). These rows (padding
      queries) get no dropout, where Megatron's drop some of their uniform probabilities.
    * scale: ``softmax_scale`` (SelfAttention passes ``config.softmax_scale``), else ``1/sqrt(kv_channels)``.
      ``apply_query_key_layer_scaling`` divides the scores by ``layer_number`` before the softmax and
      multiplies them back inside it, for fp16 range only: the product is unchanged, so it is ignored here.
    * dropout on the probabilities: ``attention_dropout`` (else ``config.attention_dropout``) in training mode
      only, under Megatron's model-parallel RNG (as ``DotProductAttention``, unless sequence parallel).
    * kernel: PyTorch's choice, from the priority order ``PRIMUS_FP8_SDPA_KERNELS`` gives (``kernel_priority``),
      read when the module is built; unset, cuDNN's kernel first on Hopper, PyTorch's own order elsewhere.

    Refused with ``NotImplementedError``: context parallelism, sliding-window layers, softmax types other than
    ``vanilla``, ``qk_clip`` / ``log_max_attention_logit`` (they need the max logit), ``attention_bias``,
    ``packed_seq_params`` (THD), the ``padding_causal`` and ``causal_bottom_right`` mask types, causal
    attention with ``1 < sq != sk`` and no mask, non-bool masks, and any other non-None call keyword.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **unused_kwargs,
    ):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError("SdpaAttention: context parallelism (context_parallel_size > 1)")
        if _is_window_layer(config, layer_number):
            raise NotImplementedError(f"SdpaAttention: sliding-window attention (window_size={config.window_size})")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SdpaAttention: softmax_type={config.softmax_type!r} (only 'vanilla')")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise NotImplementedError("SdpaAttention: qk_clip / log_max_attention_logit (needs the max attention logit)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernel_spec = env.sdpa_kernels()  # read once, at build: a bad value fails here
        kernel_priority(self.kernel_spec)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention: attention_bias")
        if packed_seq_params is not None:
            raise NotImplementedError("SdpaAttention: packed_seq_params (THD packed sequences)")
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if extra:
            raise NotImplementedError(f"SdpaAttention: call keywords {extra}")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type in (AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right):
            raise NotImplementedError(f"SdpaAttention: attn_mask_type={mask_type.name}")

        sq, b, np_, _ = query.shape
        sk, ng = key.size(0), key.size(2)
        if np_ % ng or value.size(2) != ng:
            raise ValueError(f"SdpaAttention: {np_} query heads, {ng} key and {value.size(2)} value heads")

        is_causal, keep, dead = False, None, None
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise NotImplementedError(f"SdpaAttention: attention_mask of dtype {attention_mask.dtype} (only bool)")
            dead = attention_mask.all(dim=-1, keepdim=True)  # query rows with every key masked out
            keep = ~attention_mask | dead  # SDPA's bool mask keeps True; dead rows are fixed up below
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise NotImplementedError(f"SdpaAttention: causal attention with sq={sq} != sk={sk} and no mask")
            is_causal = True

        gqa = {}
        if np_ != ng:
            if keep is None and _TORCH_HAS_GQA:
                gqa = {"enable_gqa": True}  # kernels read the shared key/value heads; no copy
            else:  # the memory-efficient kernel (masks) takes no enable_gqa: expand as Megatron does
                key = key.repeat_interleave(np_ // ng, dim=2)
                value = value.repeat_interleave(np_ // ng, dim=2)

        value = own_storage(value, query, key)
        # [s, b, heads, hn] -> [b, heads, s, hn] (views; SDPA needs only the last dimension contiguous)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        with self._rng(dropout_p), kernel_context(_priority_for(self.kernel_spec, q.device), q.device):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale, **gqa
            )
        if dead is not None:  # Megatron's -10000 fill makes a fully masked row uniform: the mean of the values
            out = torch.where(dead, v.mean(dim=2, keepdim=True).to(out.dtype), out)
        # [b, np, sq, hn_v] -> [sq, b, np * hn_v]
        result = out.permute(2, 0, 1, 3).reshape(sq, b, -1)
        if output_saved_by(result, _NODES_SAVING_OUTPUT):
            mark_saved_elsewhere(result)  # the FP8 output projection keeps it instead of an FP8 copy
        return result

    def _rng(self, dropout_p: float):
        """Megatron's model-parallel RNG for the dropout (different heads on different TP ranks)."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


# SDPA's autograd nodes that save the kernel's output for backward (derivatives.yaml: the flash, cuDNN and
# memory-efficient kernels, and the CPU flash kernel; the math fallback is a composition and saves no output)
_NODES_SAVING_OUTPUT = frozenset({
    "ScaledDotProductFlashAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0",
    "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductFlashAttentionForCpuBackward0",
})  # fmt: skip
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0",
                         "TransposeBackward0"})  # fmt: skip


def output_saved_by(result: torch.Tensor, nodes: frozenset) -> bool:
    """Whether ``result`` is, through views only, all of the output of an autograd node whose type is in
    ``nodes`` (nodes that save their output for backward), so that keeping ``result`` holds no new bytes. Read
    from the node types and the storage size, not by unpacking the node's saved tensors: under saved-tensor
    hooks (activation offloading) an unpack would copy them back. A reshape that copied (a clone node), a
    ``torch.where`` fix-up or a slice of the output gives False."""
    fn = result.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_NODES:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ not in nodes:
        return False
    return result.untyped_storage().nbytes() == result.numel() * result.element_size()


def _is_window_layer(config, layer_number: int) -> bool:
    window_size = getattr(config, "window_size", None)
    if not window_size:
        return False
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # older Megatron: every layer of a window_size config is windowed
        return True
    return is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None), layer_number)
