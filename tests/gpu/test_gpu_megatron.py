"""A Megatron-core GPTModel with the plugin's spec on one GPU (NCCL, TP=1): agrees with the same
model built from Megatron's BF16 local spec within FP8 tolerance, for each GPU backend."""

from __future__ import annotations

import pytest

from primus_fp8_plugin import backend_availability

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

SHAPE = dict(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, seq_length=256, micro_batch_size=4)


@pytest.mark.parametrize("backend", ["triton", "cublas", "hopper"])
def test_gpt_on_gpu_matches_bf16(nccl_world, backend):
    if not backend_availability(backend, "cuda"):
        pytest.skip(backend_availability(backend, "cuda").reason)
    from primus_fp8_plugin.megatron import is_fp8_linear
    from tools import te_compare as tc

    shape = tc.GptShape(**SHAPE)
    ids, pos = tc.batch(shape)
    fp8_model = tc.build_gpt(shape, "plugin", backend=backend)
    assert sum(is_fp8_linear(m) for m in fp8_model.modules()) == 8
    bf16_model = tc.build_gpt(shape, "bf16")
    tc.copy_weights(fp8_model, bf16_model)
    loss_bf16, g_bf16 = tc.loss_and_grads(bf16_model, ids, pos)
    loss_fp8, g_fp8 = tc.loss_and_grads(fp8_model, ids, pos)  # gradient names in the local spec's form
    worst = tc.worst_grad_error(g_fp8, g_bf16)
    print(f"{backend}: loss bf16 {loss_bf16:.5f} fp8 {loss_fp8:.5f}; worst grad error {worst}")
    assert abs(loss_fp8 - loss_bf16) / loss_bf16 < 5e-3
    assert worst[1] < 0.15


@pytest.fixture(params=["triton", "cublas", "hopper"])
def backend_with_te(request):
    """A GPU backend, with Transformer Engine importable (skipped otherwise)."""
    pytest.importorskip("transformer_engine.pytorch")
    if not backend_availability(request.param, "cuda"):
        pytest.skip(backend_availability(request.param, "cuda").reason)
    return request.param


def test_gpt_plugin_spec_matches_te_spec(nccl_world, backend_with_te):
    """TE's spec under Float8BlockScaling and the plugin's spec, same weights and inputs: the same
    quantization, so the plugin sits much closer to TE than either sits to BF16 (what remains comes
    from TE's fused attention and norm kernels, whose bf16 roundings flip a few FP8 roundings)."""
    from tools import te_compare as tc

    backend = backend_with_te
    results = tc.results_by_kind(tc.GptShape(**SHAPE), ["te", "plugin", "bf16"], backend=backend)

    def worst(a, b):
        return tc.worst_grad_error(results[a][1], results[b][1])

    (l_te, _), (l_p, _), (l_b, _) = results["te"], results["plugin"], results["bf16"]
    p_te, te_bf16, p_bf16 = worst("plugin", "te"), worst("te", "bf16"), worst("plugin", "bf16")
    print(f"{backend}: loss te {l_te:.5f} plugin {l_p:.5f} bf16 {l_b:.5f}; worst grad error plugin-vs-TE {p_te}, "
          f"TE-vs-bf16 {te_bf16}, plugin-vs-bf16 {p_bf16}")  # fmt: skip
    assert abs(l_p - l_te) / l_te < 1e-3
    assert p_te[1] < te_bf16[1], "the plugin should agree with TE better than TE agrees with BF16"


def test_plugin_linears_inside_te_spec_match_te(nccl_world, backend_with_te):
    """TE's spec with the plugin's linears swapped in against TE's own under Float8BlockScaling, same
    weights and inputs, two ways: ``plugin_te_spec`` (the plugin's fused norm+linear layers, so the
    pre-norms are the plugin's) and ``plugin_te_norms`` (TE's norms kept: only the linears differ).
    Each linear is TE-exact, so both should sit far closer to TE than FP8 sits to BF16."""
    from tools import te_compare as tc

    backend = backend_with_te
    kinds = ["te", "plugin_te_spec", "plugin_te_norms", "te_bf16"]
    results = tc.results_by_kind(tc.GptShape(**SHAPE), kinds, backend=backend)
    l_te, g_te = results["te"]
    te_bf16 = tc.worst_grad_error(g_te, results["te_bf16"][1])
    for kind in ("plugin_te_spec", "plugin_te_norms"):
        loss, grads = results[kind]
        worst = tc.worst_grad_error(grads, g_te)
        print(f"{backend} {kind}: loss {loss:.6f} (te {l_te:.6f}, te-bf16 {results['te_bf16'][0]:.6f}); worst grad "
              f"error vs TE {worst}, TE-vs-TE-bf16 {te_bf16}")  # fmt: skip
        assert abs(loss - l_te) / l_te < 2e-4, kind
        assert worst[1] < te_bf16[1] / 4, f"{kind}: inside TE's spec the plugin's linears should nearly reproduce TE"
