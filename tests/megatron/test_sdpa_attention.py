"""SdpaAttention (torch SDPA core attention) against Megatron's unfused DotProductAttention on the CPU:
outputs and q/k/v gradients, causal / padding / GQA, fp32 and bf16; the SDPA arguments it chooses (flash
eligible causal path, GQA, dropout); a whole GPTModel with it swapped in; and what it refuses."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from .common import SEQ, VOCAB, build_gpt, loss_and_grads, tiny_config

pytestmark = pytest.mark.usefixtures("megatron_world")

SQ, B, HEADS, HN = 37, 3, 4, 32  # ragged: nothing a multiple of a kernel tile


def attn_config(dtype=torch.float32, **overrides):
    kw = dict(num_attention_heads=HEADS, hidden_size=HEADS * HN, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    kw.update(overrides)
    return tiny_config(**kw)


def inputs(groups=HEADS, sk=SQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, HEADS, HN, generator=g)
    k, v = (torch.randn(sk, B, groups, HN, generator=g) for _ in range(2))
    dy = torch.randn(SQ, B, HEADS * HN, generator=g)
    return q, k, v, dy


def padding_mask(causal=False):
    """Megatron's convention (True = masked out), [b, 1, sq, sk]: sequences of 37, 20 and 5 tokens; the padded
    query rows are masked entirely (Megatron makes their softmax uniform)."""
    pad = torch.arange(SQ) >= torch.tensor([SQ, 20, 5])[:, None]
    mask = pad[:, None, :, None] | pad[:, None, None, :]
    return mask | torch.ones(SQ, SQ, dtype=torch.bool).triu(1) if causal else mask


def run(cls, config, mask_type, q, k, v, dy, mask, dtype, layer_number=1, **kw):
    """Output and q/k/v gradients (fp64 copies) of ``cls`` on ``dtype`` copies of the inputs, eval mode."""
    module = cls(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self", **kw).eval()
    x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = module(*x, mask, attn_mask_type=mask_type, attention_bias=None, packed_seq_params=None)
    out.backward(dy.to(dtype))
    return [out.double()] + [t.grad.double() for t in x]


def ulps(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |a - ref| in bf16 ulps of max |ref| (bf16 keeps 8 significant bits)."""
    return ((a - ref).abs().max() / 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)).item()


CASES = {  # mask type, mask, key/value groups
    "causal": ("causal", None, HEADS),
    "causal_explicit_mask": ("causal", padding_mask(causal=True), HEADS),
    "padding": ("padding", padding_mask(), HEADS),
    "gqa_causal": ("causal", None, 2),
    "gqa_padding": ("padding", padding_mask(), 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_dot_product_attention(case, dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    mask_type, mask, groups = CASES[case]
    mask_type = AttnMaskType[mask_type]
    q, k, v, dy = inputs(groups)
    config = attn_config(dtype, num_query_groups=groups)
    ours = run(SdpaAttention, config, mask_type, q, k, v, dy, mask, dtype)
    megatron = run(DotProductAttention, config, mask_type, q, k, v, dy, mask, dtype)
    assert ours[0].shape == (SQ, B, HEADS * HN)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for name, a, ref in zip(names, ours, megatron):
            assert (a - ref).abs().max() <= 1e-5 * ref.abs().max(), name
    else:  # Megatron rounds scores and probabilities to bf16, SDPA keeps them in fp32: a few ulps apart
        exact = run(DotProductAttention, attn_config(num_query_groups=groups), mask_type, q, k, v, dy, mask, torch.float64)
        for name, a, ref, ref64 in zip(names, ours, megatron, exact):
            assert ulps(a, ref) <= 4, (name, ulps(a, ref))
            assert ulps(a, ref64) <= 3, (name, ulps(a, ref64))


def test_softmax_scale_and_query_key_layer_scaling():
    """config.softmax_scale (what SelfAttention passes) and apply_query_key_layer_scaling (a no-op in exact
    arithmetic: Megatron divides the scores by layer_number and multiplies them back in the softmax)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    q, k, v, dy = inputs()
    config = attn_config(softmax_scale=0.3, apply_query_key_layer_scaling=True)
    causal = AttnMaskType.causal
    for scale in (None, config.softmax_scale):
        ours = run(SdpaAttention, config, causal, q, k, v, dy, None, torch.float32, layer_number=3, softmax_scale=scale)
        ref = run(DotProductAttention, config, causal, q, k, v, dy, None, torch.float32, layer_number=3, softmax_scale=scale)
        for a, r in zip(ours, ref):
            assert (a - r).abs().max() <= 1e-5 * r.abs().max()
    assert SdpaAttention(config, 3, causal, "self", softmax_scale=0.3).softmax_scale == 0.3
    assert SdpaAttention(attn_config(), 1, causal, "self").softmax_scale == 1 / math.sqrt(HN)


def test_sdpa_arguments_and_dropout(monkeypatch):
    """Causal without a mask takes SDPA's is_causal path (flash eligible), GQA without a mask passes the
    grouped heads through (enable_gqa), a mask becomes SDPA's keep-mask, dropout only in training."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import _TORCH_HAS_GQA, SdpaAttention

    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(dict(kw, k_heads=k.size(1)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    causal, padding = AttnMaskType.causal, AttnMaskType.padding
    q, k, v, _ = inputs()
    attn = SdpaAttention(attn_config(attention_dropout=0.0), 1, causal, "self", attention_dropout=0.5).eval()
    eval_out = attn(q, k, v, None)
    assert calls[-1] == dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=1 / math.sqrt(HN), k_heads=HEADS)
    attn.train()
    a, b = attn(q, k, v, None), attn(q, k, v, None)
    assert calls[-1]["dropout_p"] == 0.5 and not torch.equal(a, b) and not torch.equal(a, eval_out)
    assert torch.isfinite(a).all()

    attn.eval()
    mask = padding_mask()
    attn(q, k, v, mask, attn_mask_type=padding)
    assert calls[-1]["is_causal"] is False and torch.equal(calls[-1]["attn_mask"], ~mask | mask.all(-1, keepdim=True))
    attn(q, k, v, None, inference_context=None, some_future_keyword=None)  # None-valued extras are accepted
    attn(q[:1], k, v, None)  # one query against a KV cache: no mask, as Megatron's softmax does for sq == 1
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"] is None

    q, k, v, _ = inputs(groups=2)
    gqa = SdpaAttention(attn_config(num_query_groups=2), 1, causal, "self")
    gqa(q, k, v, None)
    assert calls[-1].get("enable_gqa", False) is _TORCH_HAS_GQA and calls[-1]["k_heads"] == (2 if _TORCH_HAS_GQA else HEADS)
    gqa(q, k, v, padding_mask())
    assert "enable_gqa" not in calls[-1] and calls[-1]["k_heads"] == HEADS  # masks: expanded as Megatron does


def _swap_core_attention(spec, cls):
    from megatron.core.transformer.spec_utils import ModuleSpec

    attn = spec.submodules.self_attention
    sub = dataclasses.replace(attn.submodules, core_attention=ModuleSpec(module=cls))
    layer_sub = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attn, submodules=sub))
    return dataclasses.replace(spec, submodules=layer_sub)


def _fp32_gpt(spec):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(attn_config(hidden_size=256), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def test_gpt_with_sdpa_core_attention_gives_megatrons_loss():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    local = get_gpt_layer_local_spec()
    swapped = _swap_core_attention(local, SdpaAttention)
    assert swapped.submodules.self_attention.submodules.core_attention.module is SdpaAttention
    model = _fp32_gpt(swapped)
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, SdpaAttention)
    loss_ref, g_ref = loss_and_grads(_fp32_gpt(local))
    loss, g = loss_and_grads(model)
    assert abs(loss - loss_ref) <= 1e-6 * loss_ref and g.keys() == g_ref.keys()
    for n in g_ref:
        assert (g[n] - g_ref[n]).abs().max() <= 1e-4 * g_ref[n].abs().max(), n
    loss_ref, _ = loss_and_grads(build_gpt(local))  # bf16, as the plugin trains
    loss, _ = loss_and_grads(build_gpt(swapped))
    assert abs(loss - loss_ref) <= 2e-3 * loss_ref


def _refusals():
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v, _ = inputs()
    causal = "causal"
    return {  # name: (config overrides, mask type, call)
        "context_parallel": (dict(context_parallel_size=2), causal, None),
        "sliding_window": (dict(window_size=(8, 0)), causal, None),
        "softmax_off_by_one": (dict(softmax_type="off-by-one"), causal, None),
        "qk_clip": (dict(log_max_attention_logit=True), causal, None),
        "attention_bias": ({}, causal, lambda m: m(q, k, v, None, attention_bias=torch.zeros(1, HEADS, SQ, SQ))),
        "packed_seq_params": ({}, causal, lambda m: m(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))),
        "padding_causal": ({}, "padding_causal", lambda m: m(q, k, v, padding_mask())),
        "causal_sq_ne_sk": ({}, causal, lambda m: m(q, torch.cat([k, k]), torch.cat([v, v]), None)),
        "float_mask": ({}, "padding", lambda m: m(q, k, v, torch.zeros(B, 1, SQ, SQ))),
        "unknown_keyword": ({}, causal, lambda m: m(q, k, v, None, inference_context=object())),
    }


@pytest.mark.parametrize("name", list(_refusals()))
def test_refuses_what_it_does_not_implement(name):
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    overrides, mask_type, call = _refusals()[name]
    if call is None:  # refused when built
        with pytest.raises(NotImplementedError, match="SdpaAttention"):
            SdpaAttention(attn_config(**overrides), 1, AttnMaskType[mask_type], "self")
        return
    attn = SdpaAttention(attn_config(**overrides), 1, AttnMaskType[mask_type], "self")
    with pytest.raises(NotImplementedError, match="SdpaAttention"):
        call(attn)


@pytest.mark.parametrize("groups, value_groups", [(3, 3), (2, 1)])
def test_refuses_head_counts_that_do_not_group(groups, value_groups):
    # 4 query heads: 3 key/value groups do not divide them; keys and values with different group counts
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import SdpaAttention

    q, k, v, _ = inputs(groups=groups)
    attn = SdpaAttention(attn_config(), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match=r"SdpaAttention: 4 query heads"):
        attn(q, k, v[:, :, :value_groups], None)


def _saved_storages(module, q, k, v, mask_type):
    """Bytes of each distinct storage SDPA saves for backward, and the output and gradients."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(q, k, v, None, attn_mask_type=mask_type, attention_bias=None, packed_seq_params=None)
    return seen, out


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no-rope"])
def test_value_view_of_the_qkv_output_is_saved_alone_after_rope(rope):
    """Megatron's fused QKV output split into views (GQA: 4 query heads, 2 groups, as Megatron lays them out):
    after RoPE (new query and key tensors) SDPA saves the value's own bytes, not the whole projection output;
    without RoPE the buffer is needed anyway and is saved as it is. Output and gradients bit for bit those of
    the same attention on a separate copy of the value."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import SdpaAttention, own_storage

    groups, per = 2, HEADS // 2
    g = torch.Generator().manual_seed(3)
    start = torch.randn(SQ, B, groups, (per + 2) * HN, generator=g)
    dy = torch.randn(SQ, B, HEADS * HN, generator=g)
    module = SdpaAttention(config=attn_config(num_query_groups=groups), layer_number=1, attn_mask_type=AttnMaskType.causal)

    def split(x):
        q, k, v = torch.split(x, [per * HN, HN, HN], dim=3)
        q = q.reshape(SQ, B, HEADS, HN)
        return (q * 1.0, k * 1.0, v) if rope else (q, k, v)  # "* 1.0": RoPE's new tensors

    mixed = start.clone().requires_grad_()
    q, k, v = split(mixed)
    seen, out = _saved_storages(module, q, k, v, AttnMaskType.causal)
    out.backward(dy)
    assert (mixed.untyped_storage().data_ptr() in seen) != rope, "the QKV buffer is saved iff query and key view it"
    if rope:
        assert max(seen.values()) <= max(t.numel() * t.element_size() for t in (q, out)), "nothing larger than q"
    twin = start.clone().requires_grad_()
    q2, k2, v2 = split(twin)
    out2 = module(q2, k2, v2.contiguous(), None, attn_mask_type=AttnMaskType.causal, attention_bias=None,
                  packed_seq_params=None)  # fmt: skip
    out2.backward(dy)
    assert torch.equal(out, out2) and torch.equal(mixed.grad, twin.grad)
    with torch.no_grad():
        q3, k3, v3 = split(start)
        assert own_storage(v3, q3, k3) is v3, "no gradient, nothing saved: no copy"


def test_output_is_marked_for_the_projection_only_where_sdpa_saves_it():
    """The output is marked ``saved elsewhere`` (the FP8 output projection then keeps it instead of an FP8 copy)
    only where it is a view of all of the tensor SDPA's node saves: a training causal call; not without a
    gradient, not after the fully-masked-row fix-up (a new tensor), not from the math kernel (it saves no
    output)."""
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_fp8_plugin.megatron.attention import SdpaAttention
    from primus_fp8_plugin.ops.api import SAVED_ELSEWHERE

    module = SdpaAttention(config=attn_config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, k, v, _ = inputs()

    def marked(mask=None, grad=True, mask_type=AttnMaskType.causal):
        x = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = module(*x, mask, attn_mask_type=mask_type, attention_bias=None, packed_seq_params=None)
        return bool(getattr(out, SAVED_ELSEWHERE, False))

    assert marked()
    assert not marked(grad=False)
    assert not marked(padding_mask(), mask_type=AttnMaskType.padding)  # dead rows: torch.where's new tensor
    with sdpa_kernel([SDPBackend.MATH]):
        assert not marked()


def test_kernel_priority_reads_the_environment_and_refuses_unknown_names(monkeypatch):
    from torch.nn.attention import SDPBackend

    from primus_fp8_plugin.megatron.attention import KERNELS_ENV, kernel_priority

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert kernel_priority() is None  # no device: PyTorch's order
    assert kernel_priority(device=torch.device("cpu")) is None
    assert kernel_priority(" cudnn, Flash ,efficient") == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                          SDPBackend.EFFICIENT_ATTENTION]  # fmt: skip
    assert kernel_priority("torch", torch.device("cuda", 0)) is None
    monkeypatch.setenv(KERNELS_ENV, "math")
    assert kernel_priority() == [SDPBackend.MATH]
    with pytest.raises(ValueError, match="unknown SDPA kernel.*'fa3'.*'torch'.*cudnn, flash, efficient, math"):
        kernel_priority("cudnn,fa3")
    with pytest.raises(ValueError, match="unknown SDPA kernel.*'torch'"):
        kernel_priority("torch,flash")  # 'torch' stands alone


@pytest.mark.parametrize("capability, hip, first", [((9, 0), None, "CUDNN_ATTENTION"), ((8, 0), None, None),
                                                    ((10, 0), None, None), ((9, 5), "6.4", None)])  # fmt: skip
def test_unset_kernel_order_puts_cudnn_first_on_nvidia_hopper_only(monkeypatch, capability, hip, first):
    from primus_fp8_plugin.megatron import attention

    monkeypatch.delenv(attention.KERNELS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    kernels = attention.kernel_priority(device=torch.device("cuda", 0))
    assert (kernels[0].name if kernels else None) == first
    if first:
        assert [k.name for k in kernels] == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def test_sdpa_attention_reads_the_kernel_order_at_build(monkeypatch):
    from megatron.core.transformer.enums import AttnMaskType

    from primus_fp8_plugin.megatron.attention import KERNELS_ENV, SdpaAttention

    monkeypatch.setenv(KERNELS_ENV, "cudnn,fa3")
    with pytest.raises(ValueError, match="fa3"):
        SdpaAttention(attn_config(), 1, AttnMaskType.causal, "self")


def test_kernel_order_keeps_an_enclosing_restriction():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_fp8_plugin.megatron.attention import kernel_context, kernel_priority

    cuda = torch.device("cuda", 0)  # only the flags are touched: no GPU needed
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        with kernel_context(kernel_priority("cudnn,flash,efficient,math"), cuda):
            on = [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                  torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()]  # fmt: skip
        assert on == [False, True, False, True]  # re-ordered within the caller's choice, nothing re-enabled
        with kernel_context(kernel_priority("cudnn"), cuda):
            assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    with kernel_context(kernel_priority("cudnn"), cuda):
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # restored on exit


def test_output_saved_by_follows_views_to_a_saving_node_only():
    from primus_fp8_plugin.megatron.attention import output_saved_by

    class FusedAttnFunc(torch.autograd.Function):  # stands for TE's: saves its output, as that one does
        @staticmethod
        def forward(ctx, x):
            out = x * 2
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, dy):
            return dy * 2

    nodes = frozenset({"FusedAttnFuncBackward"})
    out = FusedAttnFunc.apply(torch.randn(6, 2, 4, 8, requires_grad=True))  # [s, b, heads, d]
    assert output_saved_by(out, nodes)
    assert output_saved_by(out.view(6, 2, 32), nodes)
    assert output_saved_by(out.permute(1, 0, 2, 3).transpose(0, 1).reshape(6, 2, 32), nodes)
    assert output_saved_by(out.permute(1, 0, 2, 3).reshape(2, 6, 32), nodes)  # [b, s, h*d]: still a view
    assert not output_saved_by(out.permute(1, 0, 2, 3).reshape(12, 32), nodes)  # b and s merged: the reshape copied
    assert not output_saved_by(out[:3], nodes)  # part of the storage: the rest stays alive
    assert not output_saved_by(out + 0, nodes)
    assert not output_saved_by(out.view(6, 2, 32), frozenset({"ScaledDotProductFlashAttentionBackward0"}))
    assert not output_saved_by(out.detach(), nodes)
