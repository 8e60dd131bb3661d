import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, Fp8Format, QuantParams, TensorRole


def test_defaults_match_te():
    r = BlockwiseRecipe()
    assert r.fp8_format is Fp8Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    assert r.pow2_scales is True
    assert r.params(TensorRole.INPUT) == QuantParams(torch.float8_e4m3fn, 1, True, 0.0)
    assert r.params(TensorRole.WEIGHT) == QuantParams(torch.float8_e4m3fn, 2, True, 0.0)
    assert r.params(TensorRole.GRAD_OUTPUT) == QuantParams(torch.float8_e4m3fn, 1, True, 0.0)


def test_hybrid_uses_e5m2_for_gradients_only():
    r = BlockwiseRecipe(fp8_format="hybrid")
    assert r.fp8_format is Fp8Format.HYBRID
    assert r.params("grad_output").fp8_dtype == torch.float8_e5m2
    assert r.params("input").fp8_dtype == torch.float8_e4m3fn
    assert r.params("weight").fp8_dtype == torch.float8_e4m3fn
    assert r.params("grad_output").fp8_max == 57344.0


def test_fp32_scales_env_is_honoured_at_construction(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert BlockwiseRecipe().pow2_scales is False
    assert BlockwiseRecipe(pow2_scales=True).pow2_scales is True  # explicit wins
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    assert BlockwiseRecipe().pow2_scales is True


def test_the_ops_default_recipe_follows_the_environment_and_is_made_once(monkeypatch):
    """An op called without a recipe uses ``default_recipe()``: ``BlockwiseRecipe()`` as the environment says at the
    call, one object per setting (not one per call)."""
    from primus_fp8_plugin.recipe import default_recipe

    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert default_recipe() == BlockwiseRecipe() and default_recipe().pow2_scales is False
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    assert default_recipe() == BlockwiseRecipe() and default_recipe().pow2_scales is True
    assert default_recipe() is default_recipe()


def test_epsilon_flows_to_every_role():
    r = BlockwiseRecipe(amax_epsilon=1e-4)
    assert all(r.params(role).amax_epsilon == 1e-4 for role in TensorRole)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"fp8_format": "E5M2"}, ValueError, "Pure E5M2"),
        ({"fp8_format": Fp8Format.E5M2}, ValueError, "Pure E5M2"),
        ({"fp8_format": "E3M4"}, ValueError, "unknown fp8_format"),
        ({"x_block_scaling_dim": 2}, ValueError, "2D by 2D"),
        ({"w_block_scaling_dim": 2, "grad_block_scaling_dim": 2}, ValueError, "2D by 2D"),
        ({"x_block_scaling_dim": 3}, ValueError, "must be 1"),
        ({"amax_epsilon": -1.0}, ValueError, "amax_epsilon"),
        ({"amax_epsilon": float("nan")}, ValueError, "amax_epsilon"),
        ({"w_block_scaling_dim": 1}, NotImplementedError, "default tiling"),
    ],
)
def test_rejections(kwargs, err, match):
    with pytest.raises(err, match=match):
        BlockwiseRecipe(**kwargs)


def test_quant_params_validation():
    with pytest.raises(ValueError, match="fp8_dtype"):
        QuantParams(torch.bfloat16, 1)
    with pytest.raises(ValueError, match="block_dim"):
        QuantParams(torch.float8_e4m3fn, 3)
    assert QuantParams(torch.float8_e4m3fn, 2).tile == (128, 128)
    assert QuantParams(torch.float8_e4m3fn, 1).tile == (1, 128)


@pytest.mark.parametrize("value", ["no", "false", "1", 2, None, 1.0])
def test_pow2_scales_must_be_a_bool(value):
    # a string is truthy: "no" would silently mean power-of-2 scales
    with pytest.raises(TypeError, match=rf"pow2_scales must be True or False, got {value!r}"):
        BlockwiseRecipe(pow2_scales=value)
    with pytest.raises(TypeError, match="pow2_scales must be True or False"):
        QuantParams(torch.float8_e4m3fn, 1, pow2_scales=value)
    assert BlockwiseRecipe(pow2_scales=False).params(TensorRole.WEIGHT).pow2_scales is False
    assert QuantParams(torch.float8_e4m3fn, 1, pow2_scales=0).pow2_scales == 0  # 0 and 1 are unambiguous
