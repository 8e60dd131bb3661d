"""The config-reading ``--spec`` exports on one GPU (NCCL, TP=1), Llama-style GPT (RMSNorm, SwiGLU, RoPE, GQA):

* ``fp8_gpt_fast_layer_spec`` (fused norm+quantization, fused SwiGLU+quantization, the plugin's RoPE, SDPA)
  gives the unfused plugin spec's loss and gradients bit for bit (SDPA's math kernel in both, so that
  attention's backward is deterministic), with each fused piece used;
* ``fp8_te_gpt_layer_spec`` (TE installed) gives the loss of TE's spec with the plugin's unfused linears bit
  for bit and every gradient that TE reproduces run to run, and sits within FP8 noise of TE's own
  Float8BlockScaling stack.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from primus_fp8_plugin import backend_availability

from ..megatron.common import fused_norm_names, unfused_reference

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

SHAPE = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408)
SEQ, MBS, VOCAB = 256, 2, 1024


def config(**kw):
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    base = dict(SHAPE, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                params_dtype=torch.bfloat16, bf16=True)  # fmt: skip
    base.update(kw)
    return cpu_transformer_config(**base)


def build(spec, cfg, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                       position_embedding_type="rope")  # fmt: skip
    return Float16Module(cfg, gpt).cuda()


def copy_params(src, dst):
    """``src``'s parameters into ``dst`` (an unfused layer's norms go to the fused layer's names)."""
    dst_params, src_params = dict(dst.named_parameters()), fused_norm_names(dict(src.named_parameters()))
    assert dst_params.keys() == src_params.keys()
    with torch.no_grad():
        for n, p in src_params.items():
            dst_params[n].copy_(p)


def loss_and_grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=g).cuda()
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MBS, -1)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_fast_spec_is_the_unfused_plugin_spec_bit_for_bit(nccl_world, backend, qk_layernorm):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_fp8_plugin.megatron import fast_specs
    from primus_fp8_plugin.megatron.fast_attention import Fp8FastSelfAttention
    from primus_fp8_plugin.megatron.layers import Fp8LayerNormColumnParallelLinear
    from primus_fp8_plugin.megatron.mlp import Fp8SwigluMLP

    if backend != "auto" and not backend_availability(backend, "cuda"):
        pytest.skip(backend_availability(backend, "cuda").reason)
    cfg = config(qk_layernorm=qk_layernorm)
    ref = build(unfused_reference(cfg, backend), cfg)
    fast = build(fast_specs.get_gpt_fast_layer_spec(**{**fast_specs.spec_options(cfg), "backend": backend}), cfg)
    copy_params(ref, fast)
    with sdpa_kernel([SDPBackend.MATH]):
        l_ref, g_ref = loss_and_grads(ref)
        l_ref2, g_ref2 = loss_and_grads(ref)
        l_fast, g_fast = loss_and_grads(fast)
    assert l_ref == l_ref2 and all(torch.equal(g_ref[n], g_ref2[n]) for n in g_ref), "the reference is not reproducible"
    assert l_fast == l_ref, (l_fast, l_ref)
    g_ref = fused_norm_names(g_ref)
    differ = [n for n in g_ref if not torch.equal(g_ref[n], g_fast[n])]
    assert not differ, f"{len(differ)} gradients differ, e.g. {differ[:3]}"
    mods = list(fast.modules())
    assert sum(isinstance(m, Fp8LayerNormColumnParallelLinear) for m in mods) == 2 * cfg.num_layers
    assert all(m.fused_swiglu for m in mods if isinstance(m, Fp8SwigluMLP))
    assert [m.rope_calls for m in mods if isinstance(m, Fp8FastSelfAttention)] == [2] * cfg.num_layers  # q and k
    print(f"fast spec ({backend}, qk_layernorm={qk_layernorm}): loss {l_fast:.6f} = unfused, {len(g_ref)} gradients equal")


def test_fast_spec_with_fused_attention_trains_like_the_unfused_spec(nccl_world):
    """With SdpaAttention's default kernel order (cuDNN's first on Hopper, else PyTorch's: flash): same loss as
    the unfused spec to FP8-noise level after one step."""
    from primus_fp8_plugin.megatron import fp8_gpt_fast_layer_spec
    from primus_fp8_plugin.validate import rel_frobenius

    cfg = config()
    ref = build(unfused_reference(cfg, "auto"), cfg)
    fast = build(fp8_gpt_fast_layer_spec(cfg), cfg)
    copy_params(ref, fast)
    (l_ref, g_ref), (l_fast, g_fast) = loss_and_grads(ref), loss_and_grads(fast)
    g_ref = fused_norm_names(g_ref)
    worst = max(rel_frobenius(g_fast[n], g_ref[n]) for n in g_ref)
    print(f"fused attention: loss {l_fast:.6f} vs {l_ref:.6f}; worst gradient error {worst:.4f}")
    assert abs(l_fast - l_ref) / l_ref < 1e-3 and worst < 0.05


@pytest.fixture
def te():
    return pytest.importorskip("transformer_engine.pytorch")


def test_te_hybrid_spec_matches_te_spec_with_the_plugins_linears(nccl_world, te):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from primus_fp8_plugin.megatron import apply_fp8_blockwise, fp8_te_gpt_layer_spec
    from primus_fp8_plugin.megatron.layers import Fp8LayerNormColumnParallelLinear
    from primus_fp8_plugin.megatron.mlp import Fp8SwigluMLP
    from primus_fp8_plugin.megatron.te_attention import Fp8TEDotProductAttention
    from primus_fp8_plugin.ops.api import SAVED_ELSEWHERE
    from primus_fp8_plugin.validate import rel_frobenius

    cfg = config()
    unfused = build(apply_fp8_blockwise(get_gpt_layer_with_transformer_engine_spec()), cfg)
    hybrid = build(fp8_te_gpt_layer_spec(cfg), cfg)
    assert sum(isinstance(m, Fp8LayerNormColumnParallelLinear) for m in hybrid.modules()) == 2 * cfg.num_layers
    assert all(m.fused_swiglu for m in hybrid.modules() if isinstance(m, Fp8SwigluMLP))
    copy_params(unfused, hybrid)
    cores = [m for m in hybrid.modules() if isinstance(m, Fp8TEDotProductAttention)]
    assert len(cores) == cfg.num_layers
    marks = []  # TE's fused attention saves its output: the projection keeps it instead of an FP8 copy
    for m in cores:
        m.register_forward_hook(lambda mod, inp, out: marks.append(getattr(out, SAVED_ELSEWHERE, False)))
    l_u, g_u = loss_and_grads(unfused)
    l_u2, g_u2 = loss_and_grads(unfused)
    l_h, g_h = loss_and_grads(hybrid)
    assert marks and all(marks), f"TE attention outputs marked for the projection: {marks}"
    assert l_h == l_u == l_u2, (l_h, l_u, l_u2)
    repro = [n for n in g_u if torch.equal(g_u[n], g_u2[n])]  # TE's fused attention backward may not be
    last_mlp = [n for n in g_u if f"layers.{cfg.num_layers - 1}.mlp." in n]
    assert set(last_mlp) <= set(repro), "gradients after the last attention should be reproducible"
    differ = [n for n in repro if not torch.equal(g_u[n], g_h[n])]
    assert not differ, f"{len(differ)} reproducible gradients differ, e.g. {differ[:3]}"
    worst = max(rel_frobenius(g_h[n], g_u[n]) for n in g_u)
    print(f"te_hybrid: loss {l_h:.6f} = TE spec + plugin linears; {len(repro)}/{len(g_u)} gradients reproducible and "
          f"equal; worst over all {worst:.2e}")  # fmt: skip
    assert worst < 1e-2

    te_cfg = config(fp8="e4m3", fp8_recipe="blockwise")
    te_model = build(get_gpt_layer_with_transformer_engine_spec(), te_cfg)
    copy_params(unfused, te_model)
    l_te, _ = loss_and_grads(te_model)
    print(f"te_hybrid loss {l_h:.6f}, TE Float8BlockScaling {l_te:.6f}")
    assert abs(l_h - l_te) / l_te < 1e-3
