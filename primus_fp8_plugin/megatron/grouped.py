"""Grouped FP8 experts for Megatron-core MoE layers: the plugin's grouped linears where TE's stand.

``Fp8ColumnParallelGroupedLinear`` / ``Fp8RowParallelGroupedLinear`` follow Megatron's grouped-linear protocol
(``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2`` builders, as ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``):

* constructor ``(num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
  tp_comm_buffer_name, pg_collection, name)`` plus ``fp8_recipe`` / ``fp8_backend`` / ``fuse_wgrad_accumulation``
  (each expert's ``dW`` into its ``main_grad`` inside the grouped wgrad GEMM, whatever Megatron's
  ``gradient_accumulation_fusion`` says; False: into ``.grad``, as ``layers.py`` says);
* parameters ``weight0..`` / ``bias0..`` with TE's attributes: ``allreduce`` (False under expert parallelism or
  an expert TP size other than the dense one: the expert data-parallel group reduces them),
  ``tensor_model_parallel``, ``partition_dim`` (0 column, 1 row), ``partition_stride``; row-parallel biases are
  not partitioned. The local shard is ``output_size / expert_tp`` (column) or ``input_size / expert_tp`` (row):
  the token dispatcher does all communication;
* ``forward(x, m_splits)`` -> ``(y, None)``, or ``(y, [bias0, ..])`` with ``skip_bias_add`` (TEGroupedMLP scales
  fc2's biases by the routing probabilities); ``m_splits`` a list, an integer device tensor, a ``GroupLayout`` or
  (plain stage, ``x`` the tokens in token order) a ``permutation.Routing``;
  ``input_stage="swiglu"`` (row-parallel only): ``x`` is fc1's ``[gate | up]`` output and ``forward(x, m_splits,
  probs)`` computes SwiGLU, times each token's routing probability, quantized straight into the grouped layout
  (``ops.fp8_grouped_swiglu_linear``);
* ``backward_dw()`` (a no-op: weight gradients are computed in backward; delayed wgrad is refused);
* ``sharded_state_dict``: one key per linear with an expert axis (``...experts.linear_fc1.weight``, sharded
  over the global experts), the keys of ``SequentialMLP`` and of TE's grouped experts, so distributed
  checkpoints move between the three.

``Fp8GroupedMLP`` is Megatron's ``TEGroupedMLP`` (same constructor, parameters and checkpoint keys) that, where the
activation is plain SwiGLU (``grouped_swiglu_fusable``), runs fc1 -> fc2 with SwiGLU and the routing probabilities
fused into fc2's input quantization (the bf16 activation is never written) and the token counts kept on the device
(``TEGroupedMLP`` reads them on the host); the same bits, outputs and gradients (the router's included), as
Megatron's unfused composition (``act(fc1) * probs``, then fc2). Given a ``Routing`` in place of the counts
(``moe.RoutedTokenDispatcher``), the hidden states are the tokens in token order and fc1 reads them through the
permutation. Elsewhere it is exactly ``TEGroupedMLP``.

``Fp8Experts`` is an experts builder for ``MoESubmodules.experts``: ``Fp8GroupedMLP`` with these linears, or
``SequentialMLP`` with the dense FP8 linears, chosen by ``grouped`` or (None) by ``config.moe_grouped_gemm``
when the layer is built (Megatron-LM's ``--moe-grouped-gemm``).

``single_grouped_weight=True`` (opt-in; TE's option of that name): each grouped linear holds its experts' weights
as one parameter ``weight [E, out, in]`` instead of ``weight0..``, so that autograd's gradient accumulation,
Megatron's DDP hook, the optimizer and the gradient norm do their per-parameter work once per linear, not once per
expert; the same bits, except Megatron's global gradient norm (a sum of per-parameter fp32 norms: the one tensor is
summed in another order, ~6e-7 relative) and so a clipped step. Checkpoints are the per-expert ones:
``sharded_state_dict`` gives the weight as one ``ShardedTensorFactory`` whose data is the parameter (Megatron's
optimizers look a parameter's entry up by the tensor) and which writes each expert's ``weight{i}`` tensor (a gated
fc1's gate and up halves split as Megatron's SwiGLU factory splits them); a load pre-hook stacks ``weight0..`` into
``weight`` (and splits ``weight`` for a per-expert layer). So model weights and optimizer state (the plain
optimizer; the distributed optimizer's ``fully_reshardable`` format) move between the two layouts, SequentialMLP
and TE's. Except the distributed optimizer's default ``dp_reshardable`` format: it stores the state as the DDP
buffers lie, in parameter order, where per-expert weights lie in reverse expert order, so resumed after switching
layouts it would give each expert another expert's state (as with Megatron's own ``--moe-single-grouped-weight``):
switch layouts from a ``fully_reshardable`` checkpoint or with model weights only (``--no-load-optim``).
Megatron's Muon-type optimizers treat a 3-D weight as a non-matrix (Adam).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules, apply_swiglu_sharded_factory
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from .. import env
from ..grouped_tensor import group_layout
from ..modules import (
    HoldsWeightCache,
    expert_parameter_names,
    expert_parameters,
    match_expert_weight_layout,
    split_stacked_weight,
    take_first_microbatch,
)
from ..ops import fp8_grouped_linear, fp8_grouped_swiglu_linear
from ..permutation import Routing
from ..recipe import BlockwiseRecipe
from ..weight_cache import GroupedWeightCache
from .compat import GroupedMLPSubmodules, grouped_linear
from .fp8_params import install_hooks
from .layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear, fuse_into_main_grad
from .mlp import swiglu_fusable


def _device(config):
    if getattr(config, "init_model_with_meta_device", False):
        return torch.device("meta")
    return torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())


class Fp8GroupedLinearBase(HoldsWeightCache, torch.nn.Module):
    """The plugin's grouped linear for Megatron experts (see the module docstring); ``parallel_mode`` is
    ``"column"`` or ``"row"``."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
        fp8_recipe: BlockwiseRecipe | None = None,
        fp8_backend: str = "auto",
        fuse_wgrad_accumulation: bool = True,
        input_stage: str = "plain",
        single_grouped_weight: bool = False,
    ) -> None:
        super().__init__()
        if not is_expert:
            raise ValueError("the plugin's grouped linears are for MoE experts only (is_expert=True)")
        delayed = ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad")
        if any(getattr(config, flag, False) for flag in delayed):
            raise NotImplementedError("delayed expert wgrad (delay_wgrad_compute, overlap_dispatch_backward_with_experts_wgrad) "
                                      "is not supported by the plugin's grouped experts: turn it off")  # fmt: skip
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        stages = ("plain", "swiglu") if parallel_mode == "row" else ("plain",)
        if input_stage not in stages:
            raise ValueError(f"a {parallel_mode}-parallel grouped linear takes input_stage {stages}, got {input_stage!r}")
        self.input_stage = input_stage
        self.config = config
        self._pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self._tp_group = self._pg_collection.expt_tp
        tp_size, tp_rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)
        self.parallel_mode = parallel_mode
        self.num_gemms = num_gemms
        self.in_features = divide(input_size, tp_size) if parallel_mode == "row" else input_size
        self.out_features = divide(output_size, tp_size) if parallel_mode == "column" else output_size
        self.use_bias, self.te_return_bias = bias, bool(skip_bias_add and bias)
        self.expert_parallel = config.expert_model_parallel_size > 1
        use_expert_pgs = self.expert_parallel or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        dim = 0 if parallel_mode == "column" else 1
        per_partition = self.out_features if dim == 0 else self.in_features
        device, dtype = _device(config), config.params_dtype
        self.single_grouped_weight = bool(single_grouped_weight)
        if self.single_grouped_weight:  # one [E, out, in] parameter, each expert initialised as its own weight{i}
            stacked = torch.nn.Parameter(torch.empty(num_gemms, self.out_features, self.in_features, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(stacked, True, dim + 1, 1)
            stacked.allreduce = not use_expert_pgs
            self.register_parameter("weight", stacked)
        for i in range(num_gemms):
            if self.single_grouped_weight:
                w = self.weight.data[i]
            else:
                w = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
            if config.perform_initialization and device.type != "meta":
                if config.use_cpu_initialization:
                    _initialize_affine_weight_cpu(w, output_size, input_size, per_partition, dim, init_method,
                                                  params_dtype=dtype, rank=tp_rank, world_size=tp_size)  # fmt: skip
                else:
                    _initialize_affine_weight_gpu(w, init_method, dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(w, True, dim, 1)
            if not self.single_grouped_weight:
                w.allreduce = not use_expert_pgs
                self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype))
                if config.perform_initialization and device.type != "meta":
                    with torch.no_grad():
                        b.zero_()
                if dim == 0:
                    set_tensor_model_parallel_attributes(b, True, 0, 1)
                else:
                    b.tensor_model_parallel = False
                b.allreduce = not use_expert_pgs
                self.register_parameter(f"bias{i}", b)
            else:
                self.register_parameter(f"bias{i}", None)
        self.weight_names, self.bias_names = expert_parameter_names(num_gemms)
        if self.single_grouped_weight:
            self.weight_names = ("weight",)
        self.fp8_recipe = fp8_recipe or BlockwiseRecipe()
        self.fp8_backend = fp8_backend
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        fuse_into_main_grad(self.weights, fuse_wgrad_accumulation)
        self.weight_cache = GroupedWeightCache()
        self.is_first_microbatch: bool | None = None
        if env.fp8_params():  # FP8 primary weights in a loop the plugin does not own (Megatron-LM)
            install_hooks()
        self._register_load_state_dict_pre_hook(self._merge_extra_states)
        self._register_load_state_dict_pre_hook(self._match_weight_layout)

    @staticmethod
    def _merge_extra_states(state_dict, prefix, *args, **kwargs):
        """Distributed checkpoints hold one ``_extra_state{i}`` per expert (None here, as TE's grouped linears
        and Megatron's linears keep): keep one."""
        for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state") and k != f"{prefix}_extra_state"]:
            state_dict.pop(key)
        state_dict.setdefault(f"{prefix}_extra_state")

    def _match_weight_layout(self, state_dict, prefix, *args, **kwargs):
        """Load ``weight0..`` (per-expert parameters, TE's and Megatron's grouped linears, distributed checkpoints)
        into the single ``[E, out, in]`` weight, and a single ``weight`` into per-expert ones
        (``modules.match_expert_weight_layout``), so that state dicts move between the two layouts."""
        match_expert_weight_layout(state_dict, prefix, self.num_gemms, self.single_grouped_weight)

    def _split_grouped_checkpoint_tensor(self, tensor: torch.Tensor, checkpoint_key: str) -> list[torch.Tensor]:
        """A single grouped weight ``[E, out, in]`` as ``E`` per-expert tensors (Megatron's distributed optimizer
        calls this, by name, on grouped linears when a checkpoint's layout differs from the model's)."""
        return split_stacked_weight(tensor, self.num_gemms, checkpoint_key)

    def get_extra_state(self) -> None:
        """Nothing (as Megatron's linears): kept for TE-compatible state dicts."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored."""

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        """The weight parameters: ``weight0..`` or, with ``single_grouped_weight``, the one ``[E, out, in]``."""
        return expert_parameters(self, self.weight_names)

    @property
    def biases(self) -> list[torch.nn.Parameter] | None:
        return expert_parameters(self, self.bias_names) if self.use_bias else None

    def expert_weight(self, i: int) -> torch.Tensor:
        """Expert ``i``'s ``[out, in]`` weight (a view of the single grouped weight where there is one)."""
        return self.weight[i] if self.single_grouped_weight else getattr(self, f"weight{i}")

    def fp8_weight_source(self):
        """The weights as the grouped ops take them: ``E`` tensors, or the single ``[E, out, in]`` one."""
        weights = self.weight if self.single_grouped_weight else self.weights
        return weights, self.fp8_recipe, self.fp8_backend

    def forward(self, x: torch.Tensor, m_splits, probs: torch.Tensor | None = None):
        biases = None if self.te_return_bias else self.biases
        weights = self.fp8_weight_source()[0]
        kw = dict(recipe=self.fp8_recipe, backend=self.fp8_backend, weight_cache=self.weight_cache,
                  refresh_weight_cache=take_first_microbatch(self))  # fmt: skip
        if self.input_stage == "swiglu":
            out = fp8_grouped_swiglu_linear(x, m_splits, weights, biases, probs=probs, **kw)
        elif probs is not None:
            raise ValueError("routing probabilities (probs) are an input of the swiglu stage only (input_stage='swiglu')")
        else:
            out = fp8_grouped_linear(x, m_splits, weights, biases, **kw)
        return (out, self.biases) if self.te_return_bias else (out, None)

    def backward_dw(self) -> None:
        """Weight gradients are computed during backward (no delayed wgrad): nothing to do."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Expert ``i``'s weight (bias, extra state) under the keys of SequentialMLP's ``...linear_fc1.weight``
        with the global expert index on a new leading axis (``singleton_local_shards``: one key per expert).
        A single grouped weight is one ``ShardedTensorFactory`` whose data is the parameter (Megatron's optimizers
        find a parameter's entry by the tensor) and that writes the per-expert tensors: the same checkpoint."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep = self._pg_collection.ep
        num_global = get_pg_size(ep) * self.num_gemms
        first = get_pg_rank(ep) * self.num_gemms
        axis_map = {"weight": 0, "bias": 0} if self.parallel_mode == "column" else {"weight": 1}

        def expert_offsets(i):
            if singleton:
                return f"{first + i}.{prefix}", sharded_offsets
            return prefix, (*sharded_offsets, (len(sharded_offsets), first + i, num_global))

        def expert_shards(state, i):
            expert_prefix, offsets = expert_offsets(i)
            sub = make_sharded_tensors_for_checkpoint(
                state, "", {f"{i}.{k}": v for k, v in axis_map.items()}, offsets,
                tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"],
            )  # fmt: skip
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            return sub

        out = {}
        for i in range(self.num_gemms):
            state = {f"{i}._extra_state": None}
            if not self.single_grouped_weight:
                state[f"{i}.weight"] = self.expert_weight(i)
            if self.use_bias:
                state[f"{i}.bias"] = getattr(self, f"bias{i}")
            sub = expert_shards(state, i)
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            for name in ("weight", "bias"):
                if f"{i}.{name}" in sub:
                    out[f"{prefix}{name}{i}"] = sub[f"{i}.{name}"]
        if self.single_grouped_weight:
            out[f"{prefix}weight"] = self._single_weight_factory(prefix, expert_offsets, metadata)
        dp_rank = get_pg_rank(self._pg_collection.expt_dp)  # replicas along the expert data-parallel group
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], dp_rank)
        return out

    def _single_weight_factory(self, prefix: str, expert_offsets, metadata: dict) -> ShardedTensorFactory:
        """The single ``[E, out, in]`` weight (or an optimizer state of its shape: Megatron's optimizers rebuild the
        factory with their tensor) as the per-expert ``ShardedTensor``s of ``weight{i}``; a gated fc1's experts split
        into their gate and up halves as ``TEGroupedMLP`` splits ``weight{i}`` (Megatron's SwiGLU factory, which
        finds indexed keys only). Merged back by stacking the experts."""
        glu = self.parallel_mode == "column" and bool(getattr(self.config, "gated_linear_unit", False))
        singleton = metadata.get("singleton_local_shards", False)
        suffix, tp_axis = f"{prefix}weight", (0 if self.parallel_mode == "column" else 1)
        tp_rank, tp_size = get_pg_rank(self._tp_group), get_pg_size(self._tp_group)

        def build(key, data, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("a flattened single grouped weight (Megatron's deprecated flattened "
                                          "optimizer formats): use the fully_reshardable or dp_reshardable format")  # fmt: skip
            if not key.endswith(suffix):
                raise ValueError(f"the single grouped weight's checkpoint key {key!r} no longer ends with {suffix!r}: "
                                 "renaming the layer's own prefix is not supported (prefixes before it are)")  # fmt: skip
            head = key[: len(key) - len(suffix)]  # Megatron's optimizers prepend "optimizer.state.<name>."
            shards = {}
            for i in range(self.num_gemms):
                expert_prefix, offsets = expert_offsets(i)
                sh = ShardedTensor.from_rank_offsets(
                    f"{head}{expert_prefix}weight", data[i], *offsets,
                    (len(offsets) + tp_axis, tp_rank, tp_size), replica_id=replica_id, prepend_axis_num=len(offsets),
                )  # fmt: skip
                if glu:  # (its FSDP groups left out: megatron-core 0.16 takes none; no FSDP here)
                    sh = apply_swiglu_sharded_factory(sh, offsets, singleton).build()
                shards[i] = sh
            return shards

        def merge(loaded):
            return torch.stack([torch.cat(loaded[i]) if glu else loaded[i] for i in range(self.num_gemms)])

        return ShardedTensorFactory(f"{prefix}weight", self.weight, build, merge, replica_id=(0, 0, 0))

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in={self.in_features}, out={self.out_features} (per expert, local shard), "
            f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, input_stage={self.input_stage}, "
            f"single_grouped_weight={self.single_grouped_weight}, backend={self.fp8_backend}"
        )


class Fp8ColumnParallelGroupedLinear(Fp8GroupedLinearBase):
    """Column-parallel grouped linear (``linear_fc1`` of ``TEGroupedMLP``): output features split over expert TP."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class Fp8RowParallelGroupedLinear(Fp8GroupedLinearBase):
    """Row-parallel grouped linear (``linear_fc2`` of ``TEGroupedMLP``): input features split over expert TP."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


def grouped_swiglu_fusable(config) -> bool:
    """Whether ``Fp8GroupedMLP`` fuses SwiGLU into fc2 for ``config``: a plain SwiGLU activation
    (``mlp.swiglu_fusable``), no expert biases (TEGroupedMLP adds fc2's scaled by the probabilities), no GLU
    interleaving, no fine-grained offloading of the expert activations, no TE op fuser, no TE FP8/FP4 padding."""
    offloaded = getattr(config, "fine_grained_activation_offloading", False) and bool(
        {"expert_fc1", "moe_act", "fused_group_mlp"} & set(getattr(config, "offload_modules", None) or ())
    )
    return (
        swiglu_fusable(config)
        and not config.add_bias_linear
        and getattr(config, "moe_mlp_glu_interleave_size", None) is None
        and not offloaded
        and not getattr(config, "use_transformer_engine_op_fuser", False)
        and not (getattr(config, "fp8", None) or getattr(config, "fp4", None))
    )


def _with_swiglu_stage(fc2):
    """fc2's entry (a builder ``partial`` or a ``ModuleSpec``, as ``compat.grouped_linear`` makes them) building a
    ``Fp8RowParallelGroupedLinear`` with the swiglu input stage, or None where fc2 is another module."""
    if isinstance(fc2, partial):
        cls, params = fc2.func, dict(fc2.keywords)
    elif isinstance(fc2, ModuleSpec):
        cls, params = fc2.module, dict(fc2.params or {})
    else:
        cls, params = fc2, {}
    if not (isinstance(cls, type) and issubclass(cls, Fp8RowParallelGroupedLinear)):
        return None
    return grouped_linear(cls, **{**params, "input_stage": "swiglu"})


class Fp8GroupedMLP(TEGroupedMLP):
    """Megatron's ``TEGroupedMLP`` with SwiGLU and the routing probabilities fused into fc2's input quantization
    where ``grouped_swiglu_fusable(config)`` and fc2 is the plugin's (module docstring); ``fused_swiglu`` says
    which. Constructor and checkpoints: ``TEGroupedMLP``'s."""

    def __init__(self, num_local_experts, config, submodules, *args, **kwargs):
        fc2 = _with_swiglu_stage(submodules.linear_fc2) if grouped_swiglu_fusable(config) else None
        if fc2 is not None:
            submodules = dataclasses.replace(submodules, linear_fc2=fc2)
        super().__init__(num_local_experts, config, submodules, *args, **kwargs)
        self.fused_swiglu = fc2 is not None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        if not self.fused_swiglu or any(a is not None for a in (*args, *kwargs.values())):  # output buffers (TE)
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if isinstance(tokens_per_expert, Routing):  # the tokens in token order (moe.RoutedTokenDispatcher)
            h, _ = self.linear_fc1(x, tokens_per_expert)
            out, _ = self.linear_fc2(h, tokens_per_expert.layout, probs)
            return out, None
        # one layout for fc1 and fc2, the counts kept where they are (no host read)
        layout = group_layout(tokens_per_expert, x.shape[0], x.device, num_groups=self.num_local_experts)
        if self.config.moe_apply_probs_on_input:  # as TEGroupedMLP: the input scaled, the activation by ones
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), None
        h, _ = self.linear_fc1(x, layout)
        out, _ = self.linear_fc2(h, layout, probs)
        return out, None


def grouped_mlp(recipe: BlockwiseRecipe | None = None, backend: str = "auto", single_grouped_weight: bool = False):
    """Experts builder: ``Fp8GroupedMLP`` (Megatron's ``TEGroupedMLP``, SwiGLU fused into fc2 where it can be) with
    the plugin's grouped FP8 linears (no TE needed); ``single_grouped_weight``: each linear's experts in one
    ``[E, out, in]`` parameter."""
    kw = {"fp8_recipe": recipe, "fp8_backend": backend, "single_grouped_weight": single_grouped_weight}
    sub = GroupedMLPSubmodules(linear_fc1=grouped_linear(Fp8ColumnParallelGroupedLinear, **kw),
                               linear_fc2=grouped_linear(Fp8RowParallelGroupedLinear, **kw))  # fmt: skip
    return partial(Fp8GroupedMLP, submodules=sub)


def sequential_mlp(recipe: BlockwiseRecipe | None = None, backend: str = "auto"):
    """Experts builder: Megatron's ``SequentialMLP`` with the plugin's dense FP8 linears (one GEMM per expert)."""
    params = {"fp8_recipe": recipe, "fp8_backend": backend}
    sub = MLPSubmodules(linear_fc1=ModuleSpec(module=Fp8ColumnParallelLinear, params=params),
                        linear_fc2=ModuleSpec(module=Fp8RowParallelLinear, params=dict(params)))  # fmt: skip
    return partial(SequentialMLP, submodules=sub)


class Fp8Experts:
    """Experts builder (``MoESubmodules.experts``): grouped experts (``grouped_mlp``) if ``grouped``, else
    ``SequentialMLP`` (``sequential_mlp``); ``grouped=None`` decides by ``config.moe_grouped_gemm`` when the
    layer is built."""

    def __init__(self, recipe: BlockwiseRecipe | None = None, backend: str = "auto", grouped: bool | None = None,
                 single_grouped_weight: bool = False):  # fmt: skip
        self.recipe, self.backend, self.grouped = recipe, backend, grouped
        self.single_grouped_weight = single_grouped_weight

    def __call__(self, num_local_experts, config, /, *, pg_collection=None, **kwargs):
        # kwargs: what this MoELayer passes on (``name`` from megatron-core 0.18, which older experts lack)
        grouped = self.grouped if self.grouped is not None else bool(getattr(config, "moe_grouped_gemm", False))
        build = grouped_mlp(self.recipe, self.backend, self.single_grouped_weight) if grouped else sequential_mlp(
            self.recipe, self.backend)  # fmt: skip
        return build(num_local_experts, config, pg_collection=pg_collection, **kwargs)

    def __repr__(self) -> str:
        mode = {None: "by config.moe_grouped_gemm", True: "grouped", False: "sequential"}[self.grouped]
        return f"Fp8Experts({mode}, backend={self.backend})"
