"""The plugin's grouped experts in Megatron-core MoE layers (CPU, gloo, TP=1): specs, TE's grouped-linear
protocol, bit-identity with SequentialMLP experts, distributed checkpoints moving between the two, main_grad
fusion and the first-microbatch refresh. Multi-rank runs (EP=2, expert TP=2): test_moe_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from .common import build_gpt, loss_and_grads, tiny_config

pytestmark = pytest.mark.usefixtures("megatron_world")

NUM_EXPERTS = 4


def moe_config(**overrides):
    # allgather dispatcher (alltoall needs CUDA streams); SwiGLU experts (fc1's checkpoint keys go through
    # Megatron's swiglu factory); no expert biases (Megatron 0.19.2's own BF16 MoE fails with them at TP=1)
    kw = dict(num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="allgather", add_bias_linear=False,
              gated_linear_unit=True, activation_func=F.silu, moe_ffn_hidden_size=384)  # fmt: skip
    kw.update(overrides)
    return tiny_config(**kw)


def moe_spec(grouped, backend="reference", single_grouped_weight=False):
    from primus_fp8_plugin.megatron import get_gpt_layer_spec

    return get_gpt_layer_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=grouped, backend=backend,
                              single_grouped_weight=single_grouped_weight)  # fmt: skip


def sequential_name(name: str) -> str:
    """``...experts.linear_fc1.weight3`` -> ``...experts.local_experts.3.linear_fc1.weight``."""
    if ".experts.linear_fc" not in name:
        return name
    head, tail = name.split(".experts.")
    linear, param = tail.split(".")
    kind = param.rstrip("0123456789")
    return f"{head}.experts.local_experts.{param[len(kind) :]}.{linear}.{kind}"


def test_specs_put_the_grouped_experts_where_te_grouped_mlp_stands():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from primus_fp8_plugin.megatron import (
        Fp8ColumnParallelGroupedLinear,
        Fp8ColumnParallelLinear,
        Fp8RowParallelGroupedLinear,
        Fp8SpecProvider,
        fp8_gpt_moe_layer_spec,
    )
    from primus_fp8_plugin.megatron.grouped import Fp8GroupedMLP

    # the provider through Megatron's own MoE spec builder (its return type differs by version: compat.py)
    provider = Fp8SpecProvider(backend="reference")
    for grouped, kind, linear in ((True, Fp8GroupedMLP, Fp8ColumnParallelGroupedLinear), (False, SequentialMLP, None)):
        moe = get_moe_module_spec_for_backend(backend=provider, num_experts=NUM_EXPERTS, moe_grouped_gemm=grouped)
        layer = moe_spec(False)
        layer = ModuleSpec(module=layer.module, params=layer.params,
                           submodules=dataclasses.replace(layer.submodules, mlp=moe))  # fmt: skip
        experts = build_gpt(layer, moe_config()).module.decoder.layers[0].mlp.experts
        assert type(experts) is kind
        fc1 = experts.linear_fc1 if grouped else experts.local_experts[0].linear_fc1
        assert isinstance(fc1, linear or Fp8ColumnParallelLinear) and fc1.fp8_backend == "reference"
    model = build_gpt(moe_spec(True), moe_config())
    experts = model.module.decoder.layers[0].mlp.experts
    assert isinstance(experts, TEGroupedMLP) and isinstance(experts.linear_fc2, Fp8RowParallelGroupedLinear)
    assert experts.fused_swiglu and experts.linear_fc2.input_stage == "swiglu"
    fc1 = experts.linear_fc1
    assert fc1.num_gemms == NUM_EXPERTS and fc1.weight3.shape == (768, 256) and experts.linear_fc2.weight0.shape == (256, 384)
    # TE's parameter attributes (EP=1, expert TP = TP: reduced with the dense data-parallel group)
    for lin, dim in ((fc1, 0), (experts.linear_fc2, 1)):
        for w in lin.weights:
            assert w.allreduce and w.tensor_model_parallel and w.partition_dim == dim and w.partition_stride == 1
    # the module-level spec follows config.moe_grouped_gemm (Megatron-LM's --moe-grouped-gemm)
    kinds = {}
    for flag in (True, False):
        m = build_gpt(fp8_gpt_moe_layer_spec, moe_config(moe_grouped_gemm=flag, num_moe_experts=8))
        kinds[flag] = type(m.module.decoder.layers[0].mlp.experts)
    assert kinds == {True: Fp8GroupedMLP, False: SequentialMLP}


def test_grouped_experts_equal_sequential_experts_and_share_their_checkpoints(tmp_path):
    """A SequentialMLP model's distributed checkpoint loads into the grouped model (other initial weights):
    same loss and gradients bit for bit (grouped == a loop of the dense linears); the grouped model's
    checkpoint loads back into a SequentialMLP model exactly."""
    from megatron.core import dist_checkpointing

    cfg = moe_config()
    seq = build_gpt(moe_spec(False), cfg, seed=0)
    ckpt = tmp_path / "sequential"
    ckpt.mkdir()
    dist_checkpointing.save(seq.module.sharded_state_dict(), str(ckpt))
    grouped = build_gpt(moe_spec(True), cfg, seed=5)
    grouped.module.load_state_dict(dist_checkpointing.load(grouped.module.sharded_state_dict(), str(ckpt)))
    loss_s, grads_s = loss_and_grads(seq)
    loss_g, grads_g = loss_and_grads(grouped)
    assert loss_g == loss_s
    assert {sequential_name(n) for n in grads_g} == set(grads_s)
    for name, g in grads_g.items():
        assert torch.equal(g, grads_s[sequential_name(name)]), name
    assert any(".experts.linear_fc1.weight3" in n and g.abs().sum() > 0 for n, g in grads_g.items())

    back = tmp_path / "grouped"
    back.mkdir()
    with torch.no_grad():  # move the grouped model away from the SequentialMLP weights first
        for p in grouped.parameters():
            p.mul_(0.5)
    dist_checkpointing.save(grouped.module.sharded_state_dict(), str(back))
    seq2 = build_gpt(moe_spec(False), cfg, seed=9)
    seq2.module.load_state_dict(dist_checkpointing.load(seq2.module.sharded_state_dict(), str(back)))
    params_g = dict(grouped.named_parameters())
    for name, p in seq2.named_parameters():
        src = next(n for n in params_g if sequential_name(n) == name)
        assert torch.equal(p, params_g[src]), name


def per_expert_name(name: str) -> str | None:
    """``...experts.linear_fc1.weight3`` -> ``...experts.linear_fc1.weight`` (its single grouped weight)."""
    head, _, tail = name.rpartition(".")
    return f"{head}.weight" if ".experts.linear_fc" in name and tail.startswith("weight") else None


def test_single_grouped_weight_equals_per_expert_weights_and_shares_their_checkpoints(tmp_path):
    """Each grouped linear's experts in one ``weight [E, out, in]`` parameter: the per-expert model's distributed
    checkpoint loads into it, loss and gradients are the per-expert model's bit for bit (expert ``i``'s gradient is
    ``weight.grad[i]``), its checkpoint loads back into a SequentialMLP model, and plain state dicts move between
    the two layouts both ways."""
    from megatron.core import dist_checkpointing

    cfg = moe_config()
    per_expert = build_gpt(moe_spec(True), cfg, seed=0)
    ckpt = tmp_path / "per_expert"
    ckpt.mkdir()
    dist_checkpointing.save(per_expert.module.sharded_state_dict(), str(ckpt))
    single = build_gpt(moe_spec(True, single_grouped_weight=True), cfg, seed=5)
    fc1 = single.module.decoder.layers[0].mlp.experts.linear_fc1
    assert fc1.single_grouped_weight and [n for n, _ in fc1.named_parameters()] == ["weight"]
    assert fc1.weight.shape == (NUM_EXPERTS, 768, 256) and fc1.weight.allreduce and fc1.weight.partition_dim == 1
    single.module.load_state_dict(dist_checkpointing.load(single.module.sharded_state_dict(), str(ckpt)))
    loss_p, grads_p = loss_and_grads(per_expert)
    loss_s, grads_s = loss_and_grads(single)
    assert loss_s == loss_p
    for name, g in grads_p.items():
        stacked = per_expert_name(name)
        if stacked is None:
            assert torch.equal(grads_s[name], g), name
        else:
            assert torch.equal(grads_s[stacked][int(name.rpartition("weight")[2])], g), name
    assert {per_expert_name(n) or n for n in grads_p} == set(grads_s)

    back = tmp_path / "single"
    back.mkdir()
    with torch.no_grad():
        for p in single.parameters():
            p.mul_(0.5)
    dist_checkpointing.save(single.module.sharded_state_dict(), str(back))
    seq = build_gpt(moe_spec(False), cfg, seed=9)
    seq.module.load_state_dict(dist_checkpointing.load(seq.module.sharded_state_dict(), str(back)))
    loss_q, _ = loss_and_grads(seq)
    assert loss_q == loss_and_grads(single)[0]

    # plain state dicts: the single layout's into a per-expert model and back
    other = build_gpt(moe_spec(True), cfg, seed=11)
    other.module.load_state_dict(single.module.state_dict())
    assert torch.equal(other.module.decoder.layers[0].mlp.experts.linear_fc1.weight2, fc1.weight[2])
    again = build_gpt(moe_spec(True, single_grouped_weight=True), cfg, seed=12)
    again.module.load_state_dict(other.module.state_dict())
    assert torch.equal(again.module.decoder.layers[0].mlp.experts.linear_fc1.weight, fc1.weight)
    # per-expert weights beside the grouped one (Megatron's upcycling adds them to the model's own state dict): they win
    state = fc1.state_dict()
    experts = [torch.randn(768, 256).to(torch.bfloat16) for _ in range(NUM_EXPERTS)]
    state.update({f"weight{i}": w for i, w in enumerate(experts)})
    fc1.load_state_dict(state)
    assert torch.equal(fc1.weight, torch.stack(experts))
    with pytest.raises(RuntimeError, match=r"cannot split k of shape \(3, 768, 256\) into 4 experts' weights"):
        fc1._split_grouped_checkpoint_tensor(torch.zeros(3, 768, 256), "k")


def adam_run(single: bool, distributed: bool = False, clip_grad: float = 0.0, seed: int = 0):
    """The tiny MoE GPT (grouped experts in either layout) under Megatron's DDP and Adam with fp32 masters."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from primus_fp8_plugin.megatron.cpu import CudaAsCpu

    model = build_gpt(moe_spec(True, single_grouped_weight=single), moe_config(), seed=seed)
    with CudaAsCpu():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)  # fmt: skip
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=clip_grad,
                                                     use_distributed_optimizer=distributed), [ddp])  # fmt: skip
    return ddp, opt


def adam_step(ddp, opt, step: int) -> tuple[list[float], float]:
    """One step of two microbatches: their losses and the gradient norm."""
    from primus_fp8_plugin.megatron.cpu import CudaAsCpu

    from .common import batch

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = []
    for micro in range(2):
        ids, pos = batch(seed=100 * step + micro)
        loss = ddp(ids, pos, None, labels=ids).float().mean() / 2
        loss.backward()
        losses.append(loss.item())
    ddp.finish_grad_sync()
    with CudaAsCpu():
        ok, norm, _ = opt.step()
    assert ok
    return losses, float(norm)


def expert_weights_by_name(ddp) -> dict:
    """Every parameter by name, a single grouped weight as its experts' ``weight{i}``."""
    out = {}
    for name, p in ddp.module.named_parameters():
        if per_expert_name(name + "0") == name:  # a single grouped weight
            out.update({f"{name}{i}": w.detach().clone() for i, w in enumerate(p.unbind(0))})
        else:
            out[name] = p.detach().clone()
    return out


def built_shards(sharded_state_dict) -> dict:
    """``(key, global offset) -> (global shape, replica id, data)`` of every ShardedTensor, factories built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    return {(t.key, t.global_offset): (t.global_shape, t.replica_id, t.data) for t in nested_values(sharded_state_dict)
            if isinstance(t, ShardedTensor)}  # fmt: skip


@pytest.mark.parametrize("singleton", [False, True], ids=["expert_axis", "singleton_local_shards"])
def test_single_grouped_weight_writes_the_per_expert_checkpoint(singleton):
    """The single weight's sharded state dict, built, is the per-expert layer's: the same keys, global shapes and
    offsets (fc1's gate and up halves split as Megatron's SwiGLU factory splits ``weight{i}``), replica ids and
    bits; its factory's data is the parameter itself (what Megatron's optimizers look parameters up by)."""
    metadata = {"singleton_local_shards": singleton}
    per_expert = build_gpt(moe_spec(True), moe_config(), seed=0)
    single = build_gpt(moe_spec(True, single_grouped_weight=True), moe_config(), seed=0)
    sd = single.module.sharded_state_dict(metadata=metadata)
    fc1 = single.module.decoder.layers[0].mlp.experts.linear_fc1
    assert any(getattr(v, "data", None) is fc1.weight for v in sd.values())
    want, got = built_shards(per_expert.module.sharded_state_dict(metadata=metadata)), built_shards(sd)
    assert want.keys() == got.keys() and any("linear_fc1.weight" in k for k, _ in got)
    for k, (shape, replica, data) in want.items():
        assert got[k][:2] == (shape, replica) and torch.equal(got[k][2], data), k
    # its key renamed past the layer's own prefix: refused, not written under a wrong expert key
    factory = fc1.sharded_state_dict(prefix="linear_fc1.")["linear_fc1.weight"]
    flat = dataclasses.replace(factory, flattened_range=slice(0, 8))  # Megatron's deprecated flattened formats
    with pytest.raises(NotImplementedError, match="use the fully_reshardable or dp_reshardable format"):
        flat.build()
    factory.key = "renamed.weight"
    with pytest.raises(ValueError, match="no longer ends with 'linear_fc1.weight'"):
        factory.build()


def test_optimizer_checkpoints_move_between_the_weight_layouts(tmp_path):
    """Adam's fp32 masters and moments checkpointed by Megatron's optimizer in one layout resume in the other: a step
    after loading gives the saving run's losses and every weight bit for bit, both ways (the per-expert views the
    single weight used to hand out were not parameters, and the optimizer's save failed). Megatron's distributed
    optimizer's ``fully_reshardable`` state, what it writes, is the per-expert run's, bit for bit."""
    from megatron.core import dist_checkpointing

    from primus_fp8_plugin.megatron.cpu import CudaAsCpu

    for src, dst in ((False, True), (True, False)):
        ddp, opt = adam_run(src)
        adam_step(ddp, opt, 0)
        ckpt = tmp_path / f"single_{src}"
        ckpt.mkdir()
        model_sd = ddp.module.sharded_state_dict()
        dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, str(ckpt))
        want_losses, _ = adam_step(ddp, opt, 1)
        want = expert_weights_by_name(ddp)

        ddp, opt = adam_run(dst, seed=7)
        adam_step(ddp, opt, 0)  # Adam's state exists before loading, as in a resumed Megatron-LM run
        model_sd = ddp.module.sharded_state_dict()
        state = dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
                                        str(ckpt))  # fmt: skip
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        losses, _ = adam_step(ddp, opt, 1)
        assert losses == want_losses, (src, dst)
        got = expert_weights_by_name(ddp)
        assert got.keys() == want.keys()
        assert not [n for n in want if not torch.equal(got[n], want[n])], (src, dst)

    fully = {"distrib_optim_sharding_type": "fully_reshardable"}
    shards = []
    for single in (False, True):
        ddp, opt = adam_run(single, distributed=True)
        adam_step(ddp, opt, 0)
        with CudaAsCpu():
            shards.append(built_shards(opt.sharded_state_dict(ddp.module.sharded_state_dict(), metadata=fully)))
    assert shards[0].keys() == shards[1].keys()
    assert any(k.startswith("optimizer.state.exp_avg.") and "linear_fc1.weight" in k for k, _ in shards[0])
    for k, (shape, replica, data) in shards[0].items():
        assert shards[1][k][:2] == (shape, replica) and torch.equal(shards[1][k][2], data), k


def test_the_gradient_norm_sums_the_single_weight_in_another_order():
    """Megatron's global gradient norm sums per-parameter norms in fp32: one ``[E, out, in]`` tensor is summed in
    another order than E expert tensors, so the norm differs in its last bits (measured ~6e-7 relative), and with
    it a clipped step; the unclipped steps are bit-identical (test_main_grad_fusion)."""
    norms = [[adam_step(*run, k)[1] for k in range(2)] for run in (adam_run(False, clip_grad=1.0), adam_run(True, clip_grad=1.0))]
    assert all(a > 1.0 for a in norms[0])  # clipped
    for a, b in zip(*norms):
        assert abs(a - b) <= 1e-5 * a, norms


def test_sharded_keys_are_sequential_mlps():
    """One key per expert linear with an expert axis, as SequentialMLP's (not weight0, weight1, ...)."""
    cfg = moe_config()
    keys_g = {v.key for v in build_gpt(moe_spec(True), cfg).module.sharded_state_dict().values()}
    keys_s = {v.key for v in build_gpt(moe_spec(False), cfg).module.sharded_state_dict().values()}
    assert keys_g == keys_s
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys_g and not any("weight0" in k for k in keys_g)


def test_gradient_accumulation_fusion_accumulates_every_expert_into_its_main_grad():
    from primus_fp8_plugin.megatron import Fp8ColumnParallelGroupedLinear, Fp8ColumnParallelLinear

    cfg = moe_config(gradient_accumulation_fusion=True)
    kw = dict(config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False, skip_bias_add=False, is_expert=True,
              fp8_backend="reference")  # fmt: skip
    layer = Fp8ColumnParallelGroupedLinear(3, 256, 384, **kw)
    buf = torch.randn(3 * 384 * 256 + 100)
    starts = [200 + 2 * 384 * 256 - 100, 0, 384 * 256 + 50]  # not in expert order, with gaps
    for w, s in zip(layer.weights, starts):
        w.main_grad = buf[s : s + w.numel()].view(w.shape)
        w.grad_added_to_main_grad = False
    before = [w.main_grad.clone() for w in layer.weights]
    counts = [70, 0, 133]
    x = torch.randn(sum(counts), 256, dtype=torch.bfloat16)
    y, bias = layer(x, counts)
    assert bias is None
    y.float().pow(2).sum().backward()
    for i, (w, start) in enumerate(zip(layer.weights, before)):
        assert w.grad_added_to_main_grad
        dense = Fp8ColumnParallelLinear(256, 384, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False,
                                        gather_output=False, is_expert=True, fp8_backend="reference")  # fmt: skip
        with torch.no_grad():
            dense.weight.copy_(w)
        dense.weight.main_grad = start.clone()
        dense(x[sum(counts[:i]) : sum(counts[: i + 1])])[0].float().pow(2).sum().backward()
        assert torch.equal(w.main_grad, dense.weight.main_grad), f"expert {i} (count {counts[i]})"
    assert not torch.equal(layer.weight0.main_grad, before[0]) and torch.equal(layer.weight1.main_grad, before[1])


def test_first_microbatch_mark_reaches_the_grouped_linears():
    from primus_fp8_plugin.megatron import set_is_first_microbatch
    from primus_fp8_plugin.megatron.grouped import Fp8GroupedLinearBase

    model = build_gpt(moe_spec(True), moe_config())
    grouped = [m for m in model.modules() if isinstance(m, Fp8GroupedLinearBase)]
    assert len(grouped) == 4  # fc1, fc2 in each of 2 layers
    marked = set_is_first_microbatch(model)
    assert marked == 4 + 2 * 2  # + qkv, proj per layer
    loss_and_grads(model)
    assert all(m.is_first_microbatch is False and m.weight_cache.refreshes == 1 for m in grouped)
    loss_and_grads(model)
    assert all(m.weight_cache.refreshes == 1 for m in grouped)  # weights unchanged: cached


def test_delayed_wgrad_is_refused():
    from primus_fp8_plugin.megatron import Fp8RowParallelGroupedLinear

    cfg = moe_config()
    cfg.delay_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="delayed expert wgrad"):
        Fp8RowParallelGroupedLinear(2, 384, 256, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                    skip_bias_add=True, is_expert=True)  # fmt: skip


def test_the_grouped_experts_host_work_does_not_grow_with_the_experts():
    """Megatron's grouped experts (``TEGroupedMLP`` with the plugin's grouped linears, ``triton`` backend through
    the interpreter, Megatron's DDP protocol on every weight): a steady-state forward + backward makes as many
    Python-level calls with 128 local experts as with 2 (``tests/host_calls.py`` says what is counted)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from primus_fp8_plugin import backend_availability
    from primus_fp8_plugin.megatron.grouped import grouped_mlp

    from ..host_calls import python_calls

    if not backend_availability("triton", "cpu"):
        pytest.skip(backend_availability("triton", "cpu").reason)
    calls = {}
    for e in (2, 128):
        cfg = moe_config(num_moe_experts=e, hidden_size=128, moe_ffn_hidden_size=128)
        torch.manual_seed(0)
        experts = grouped_mlp(backend="triton")(e, cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        for p in experts.parameters():
            p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
        counts = torch.zeros(e, dtype=torch.int64)
        counts[0], counts[-1] = 70, 130
        g = torch.Generator().manual_seed(1)
        x = torch.randn(200, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
        probs = torch.rand(200, generator=g)
        dy = torch.randn(200, 128, generator=g).to(torch.bfloat16)

        def step():
            out, _ = experts(x, counts, probs)
            out.backward(dy)

        step()
        calls[e] = python_calls(step)
        assert all(p.grad_added_to_main_grad and p.main_grad.abs().sum() > 0 for p in experts.linear_fc1.weights[:: e - 1])
    assert calls[2] == calls[128], calls


@pytest.mark.parametrize("probs_on_input", [False, True], ids=["probs_on_activation", "probs_on_input"])
def test_fused_grouped_swiglu_equals_te_grouped_mlps_own_forward(probs_on_input):
    """``Fp8GroupedMLP`` (SwiGLU and the routing probabilities fused into fc2's input quantization, device counts)
    against Megatron's ``TEGroupedMLP.forward`` with the same grouped linears (counts read on the host, torch's
    SwiGLU, ``* probs``, fc2): output and the gradients of the tokens, the probabilities and every weight, bit for
    bit; also with ``moe_apply_probs_on_input`` (top-1 routing)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from primus_fp8_plugin.megatron.grouped import Fp8GroupedMLP, grouped_mlp

    e = 3
    top1 = dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True) if probs_on_input else {}
    cfg = moe_config(num_moe_experts=e, **top1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    fused_builder = grouped_mlp(backend="reference")
    torch.manual_seed(0)
    fused = fused_builder(e, cfg, pg_collection=pgs)
    torch.manual_seed(0)
    plain = TEGroupedMLP(e, cfg, fused_builder.keywords["submodules"], pg_collection=pgs)
    assert isinstance(fused, Fp8GroupedMLP) and fused.fused_swiglu and type(plain) is TEGroupedMLP
    plain.load_state_dict(fused.state_dict())
    counts = torch.tensor([70, 0, 133])
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(203, 256, generator=g).to(torch.bfloat16)
    p0 = torch.rand(203, generator=g)
    dy = torch.randn(203, 256, generator=g).to(torch.bfloat16)
    results = []
    for experts in (plain, fused):
        x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        out, bias = experts(x, counts, p)
        assert bias is None
        out.backward(dy)
        results.append([out, x.grad, p.grad, *[w.grad for w in experts.parameters()]])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"result {i}"
    assert results[1][2].abs().sum() > 0  # the probabilities got a gradient


def test_apply_fp8_blockwise_turns_te_grouped_mlp_into_the_fusing_experts():
    """A TE-style experts spec (``TEGroupedMLP`` with TE's grouped linears, matched by name) becomes
    ``Fp8GroupedMLP`` with the plugin's linears, and builds with SwiGLU fused into fc2."""
    from functools import partial

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from primus_fp8_plugin.megatron import Fp8GroupedMLP, Fp8RowParallelGroupedLinear, apply_fp8_blockwise
    from primus_fp8_plugin.megatron.compat import GroupedMLPSubmodules, moe_experts

    te_like = {n: type(n, (), {}) for n in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")}
    sub = GroupedMLPSubmodules(linear_fc1=te_like["TEColumnParallelGroupedLinear"],
                               linear_fc2=te_like["TERowParallelGroupedLinear"])  # fmt: skip
    spec = apply_fp8_blockwise(moe_experts(partial(TEGroupedMLP, submodules=sub)), backend="reference")
    cls = spec.func if isinstance(spec, partial) else spec.module
    assert cls is Fp8GroupedMLP
    build = spec if isinstance(spec, partial) else partial(spec.module, submodules=spec.submodules, **(spec.params or {}))
    experts = build(4, moe_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert experts.fused_swiglu and isinstance(experts.linear_fc2, Fp8RowParallelGroupedLinear)
    assert experts.linear_fc2.fp8_backend == "reference"
