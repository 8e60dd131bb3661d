"""Build the Megatron GPT model of a run: its TransformerConfig and the layer spec that the
``fp8.mode`` selects (the plugin's FP8 spec, Megatron's BF16 layers, or TE's blockwise FP8)."""

from __future__ import annotations

import torch

from ..config.schema import TE_MODES
from ..megatron.cpu import FUSIONS_OFF
from ..recipe import BlockwiseRecipe


def transformer_config(cfg, on_cuda: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = cfg.model, cfg.parallel
    kw = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        add_bias_linear=m.add_bias_linear,
        init_method_std=m.init_method_std,
        params_dtype=torch.bfloat16,
        bf16=True,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        sequence_parallel=p.sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=(not on_cuda) or p.cpu_initialization,
        **FUSIONS_OFF,  # apex-free (Megatron's output layer refuses gradient_accumulation_fusion without apex)
    )
    if cfg.train.cuda_graph:  # init_runtime refused it on the CPU
        kw.update(cuda_graph_impl="local", cuda_graph_warmup_steps=cfg.train.cuda_graph_warmup_steps)
    if m.num_experts:
        # top-1 routing takes the softmax over all experts before choosing (Switch Transformer's router): after
        # the choice the gate would be 1 for every token and the router would get no gradient (Megatron refuses it)
        kw.update(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_token_dispatcher_type="allgather",
                  moe_grouped_gemm=m.moe_grouped_gemm, moe_router_pre_softmax=m.moe_router_topk == 1)  # fmt: skip
    if cfg.fp8.mode == "te_blockwise":  # te_bf16: the same TE spec without FP8
        kw.update(fp8="hybrid" if cfg.fp8.fp8_format == "HYBRID" else "e4m3", fp8_recipe="blockwise")
    return TransformerConfig(**kw)


def layer_spec(cfg):
    """The decoder spec for ``cfg.fp8.mode`` (a TransformerBlockSubmodules or a layer ModuleSpec)."""
    from ..megatron import apply_fp8_blockwise, get_gpt_block_spec

    m = cfg.model
    recipe = BlockwiseRecipe(fp8_format=cfg.fp8.fp8_format, pow2_scales=cfg.fp8.pow2_scales)
    if cfg.fp8.mode in TE_MODES:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        te_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=m.num_experts, moe_grouped_gemm=m.moe_grouped_gemm)
        if cfg.fp8.mode == "te_spec_blockwise":  # TE's spec, norms and attention around the plugin's linears
            from megatron.core.extensions.transformer_engine import TENorm

            return apply_fp8_blockwise(te_spec, recipe=recipe, backend=cfg.backend.name, norm=TENorm)
        return te_spec
    bf16_layers = range(m.num_layers) if cfg.fp8.mode == "bf16" else list(cfg.fp8.bf16_layers)
    return get_gpt_block_spec(
        m.num_layers, bf16_layers=bf16_layers, num_experts=m.num_experts, moe_grouped_gemm=m.moe_grouped_gemm,
        normalization=m.normalization, core_attention=m.attention, recipe=recipe, backend=cfg.backend.name,
    )  # fmt: skip


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The embedding's rows: ``vocab_size`` rounded up to a multiple of ``divisible_by x tp``, as
    Megatron-LM pads (``--make-vocab-size-divisible-by``, default 128): each tensor-parallel rank holds
    a multiple of ``divisible_by`` rows. The padding rows are no token of the data."""
    step = divisible_by * tp
    return -(-vocab_size // step) * step


def build_model(cfg, tconfig, vocab_size: int, device: torch.device):
    import contextlib
    import io
    import warnings

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice (printed, too)
        gpt = GPTModel(
            config=tconfig,
            transformer_layer_spec=layer_spec(cfg),
            vocab_size=padded_vocab(vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp),
            max_sequence_length=cfg.model.seq_length,
            position_embedding_type=cfg.model.position_embedding_type,
        )
    if device.type == "cuda":
        gpt = gpt.cuda()
    return Float16Module(tconfig, gpt)
