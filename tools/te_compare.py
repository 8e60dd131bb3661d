"""The same Megatron GPT built several ways (``KINDS``), with the same weights: Transformer Engine's
spec under ``Float8BlockScaling`` (``config.fp8 = "e4m3"``, ``fp8_recipe = "blockwise"``) or in BF16,
TE's spec with the plugin's linears, the plugin's spec, and Megatron's local BF16 spec. Used by
``tests/gpu`` and ``benchmarks/bench_gpt_layer.py`` (needs a GPU and, for the TE kinds, Transformer Engine).

Parameter names agree across the TE spec and the plugin's fused-norm spec (``linear_qkv.layer_norm_weight``
and so on); the BF16 local spec keeps its norms as separate modules, mapped by ``to_local_names``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class GptShape:
    num_layers: int = 2
    hidden_size: int = 1024
    num_attention_heads: int = 16
    ffn_hidden_size: int = 4096
    seq_length: int = 1024
    micro_batch_size: int = 4
    vocab_size: int = 1024


def transformer_config(shape: GptShape, *, te_fp8: bool):
    """BF16, fusions off, weights initialised on the CPU (the same on every build); TE's blockwise FP8
    recipe when ``te_fp8``."""
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    fp8 = dict(fp8="e4m3", fp8_recipe="blockwise") if te_fp8 else {}
    return cpu_transformer_config(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size, params_dtype=torch.bfloat16, bf16=True, **fp8,
    )  # fmt: skip


KINDS = ("te", "te_bf16", "plugin_te_spec", "plugin_te_norms", "plugin", "bf16")


def build_gpt(shape: GptShape, kind: str, backend: str = "auto", seed: int = 0, attention: str = "local") -> torch.nn.Module:
    """``kind``:

    * ``"te"``: TE's spec under Float8BlockScaling;
    * ``"te_bf16"``: TE's spec without FP8 (the control for ``"te"``);
    * ``"plugin_te_spec"``: TE's spec with the plugin's linears swapped in (``apply_fp8_blockwise``: the
      fused norm+linear layers too, so the two pre-norms are the plugin's; attention and the final norm
      stay TE's);
    * ``"plugin_te_norms"``: the same with TE's norms kept (``apply_fp8_blockwise(..., norm=TENorm)``):
      differs from ``"te"`` only in the linears;
    * ``"plugin"``: this package's spec; ``"bf16"``: Megatron's local spec.

    ``attention`` (``"local"`` or ``"sdpa"``, see ``specs.with_core_attention``) applies to the last two;
    TE's spec always uses TE's fused attention."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from primus_fp8_plugin.megatron.specs import apply_fp8_blockwise, get_gpt_block_spec, with_core_attention

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    te_spec = kind in ("te", "te_bf16", "plugin_te_spec", "plugin_te_norms")
    if te_spec and attention != "local":
        raise ValueError(f"attention={attention!r} does not apply to TE's spec (it has its own fused attention)")
    if te_spec:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
        if kind == "plugin_te_spec":
            spec = apply_fp8_blockwise(spec, backend=backend)
        elif kind == "plugin_te_norms":
            from megatron.core.extensions.transformer_engine import TENorm

            spec = apply_fp8_blockwise(spec, backend=backend, norm=TENorm)
    elif kind == "plugin":
        spec = get_gpt_block_spec(shape.num_layers, backend=backend, core_attention=attention)
    else:
        spec = with_core_attention(get_gpt_layer_local_spec(), attention)
    cfg = transformer_config(shape, te_fp8=kind == "te")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
                       max_sequence_length=shape.seq_length)  # fmt: skip
    return Float16Module(cfg, gpt).cuda()


def to_local_names(name: str) -> str:
    """A fused-norm parameter name as Megatron's local spec names it."""
    return name.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.").replace(
        "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
    )


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy every parameter of ``src`` into the parameter of the same (or local-spec) name in ``dst``."""
    dst_params = dict(dst.named_parameters())
    src_params = dict(src.named_parameters())
    mapped = {n if n in dst_params else to_local_names(n): p for n, p in src_params.items()}
    missing = sorted(set(dst_params) - set(mapped))
    extra = sorted(set(mapped) - set(dst_params))
    if missing or extra:
        raise ValueError(f"parameter names differ: missing in source {missing[:5]}, unknown in target {extra[:5]}")
    with torch.no_grad():
        for n, p in dst_params.items():
            if p.shape != mapped[n].shape:
                raise ValueError(f"{n}: shape {tuple(mapped[n].shape)} in source, {tuple(p.shape)} in target")
            p.copy_(mapped[n])


def batch(shape: GptShape, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (shape.micro_batch_size, shape.seq_length), generator=g).cuda()
    pos = torch.arange(shape.seq_length, device="cuda").unsqueeze(0).expand(shape.micro_batch_size, -1)
    return ids, pos


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean LM loss and the gradients (fp32, local-spec names) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    grads = {to_local_names(n): p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def results_by_kind(shape: GptShape, kinds: list[str], backend: str = "auto") -> dict[str, tuple[float, dict]]:
    """``loss_and_grads`` of each kind's model on the same batch; the first kind's weights are copied
    into the others (so list a fused-norm kind, e.g. ``"te"``, first: names map fused -> local only)."""
    ids, pos = batch(shape)
    source = build_gpt(shape, kinds[0], backend=backend)
    results = {kinds[0]: loss_and_grads(source, ids, pos)}
    for kind in kinds[1:]:
        model = build_gpt(shape, kind, backend=backend)
        copy_weights(source, model)
        results[kind] = loss_and_grads(model, ids, pos)
        del model
    return results


def worst_grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[str, float]:
    """(name, relative Frobenius error) of the parameter whose gradient departs most from ``ref``'s."""
    from primus_fp8_plugin.validate import rel_frobenius

    if grads.keys() != ref.keys():
        raise ValueError(f"gradient names differ: {sorted(grads.keys() ^ ref.keys())[:5]}")
    return max(((n, rel_frobenius(grads[n], ref[n])) for n in ref), key=lambda item: item[1])


def step_ms(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, reps: int = 10) -> float:
    """Median milliseconds of one forward+backward (CUDA events, after 3 warm-up steps)."""
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        model.zero_grad(set_to_none=True)
        start.record()
        model(ids, pos, None, labels=ids).float().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
