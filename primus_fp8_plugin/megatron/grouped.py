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
  fc2's biases by the routing probabilities); ``m_splits`` a list or an integer device tensor;
* ``backward_dw()`` (a no-op: weight gradients are computed in backward; delayed wgrad is refused);
* ``sharded_state_dict``: one key per linear with an expert axis (``...experts.linear_fc1.weight``, sharded
  over the global experts), the keys of ``SequentialMLP`` and of TE's grouped experts, so distributed
  checkpoints move between the three.

``Fp8Experts`` is an experts builder for ``MoESubmodules.experts``: ``TEGroupedMLP`` with these linears, or
``SequentialMLP`` with the dense FP8 linears, chosen by ``grouped`` or (None) by ``config.moe_grouped_gemm``
when the layer is built (Megatron-LM's ``--moe-grouped-gemm``).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from .. import env
from ..modules import HoldsWeightCache, expert_parameter_names, expert_parameters, take_first_microbatch
from ..ops import fp8_grouped_linear
from ..recipe import BlockwiseRecipe
from ..weight_cache import GroupedWeightCache
from .compat import GroupedMLPSubmodules, grouped_linear
from .fp8_params import install_hooks
from .layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear, fuse_into_main_grad


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
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
            if config.perform_initialization and device.type != "meta":
                if config.use_cpu_initialization:
                    _initialize_affine_weight_cpu(w, output_size, input_size, per_partition, dim, init_method,
                                                  params_dtype=dtype, rank=tp_rank, world_size=tp_size)  # fmt: skip
                else:
                    _initialize_affine_weight_gpu(w, init_method, dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(w, True, dim, 1)
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
        self.fp8_recipe = fp8_recipe or BlockwiseRecipe()
        self.fp8_backend = fp8_backend
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        fuse_into_main_grad(self.weights, fuse_wgrad_accumulation)
        self.weight_cache = GroupedWeightCache()
        self.is_first_microbatch: bool | None = None
        if env.fp8_params():  # FP8 primary weights in a loop the plugin does not own (Megatron-LM)
            install_hooks()
        self._register_load_state_dict_pre_hook(self._merge_extra_states)

    @staticmethod
    def _merge_extra_states(state_dict, prefix, *args, **kwargs):
        """Distributed checkpoints hold one ``_extra_state{i}`` per expert (None here, as TE's grouped linears
        and Megatron's linears keep): keep one."""
        for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state") and k != f"{prefix}_extra_state"]:
            state_dict.pop(key)
        state_dict.setdefault(f"{prefix}_extra_state")

    def get_extra_state(self) -> None:
        """Nothing (as Megatron's linears): kept for TE-compatible state dicts."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored."""

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        return expert_parameters(self, self.weight_names)

    @property
    def biases(self) -> list[torch.nn.Parameter] | None:
        return expert_parameters(self, self.bias_names) if self.use_bias else None

    def fp8_weight_source(self):
        return self.weights, self.fp8_recipe, self.fp8_backend

    def forward(self, x: torch.Tensor, m_splits):
        biases = None if self.te_return_bias else self.biases
        out = fp8_grouped_linear(x, m_splits, self.weights, biases, recipe=self.fp8_recipe, backend=self.fp8_backend,
                                 weight_cache=self.weight_cache, refresh_weight_cache=take_first_microbatch(self))  # fmt: skip
        return (out, self.biases) if self.te_return_bias else (out, None)

    def backward_dw(self) -> None:
        """Weight gradients are computed during backward (no delayed wgrad): nothing to do."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Expert ``i``'s weight (bias, extra state) under the keys of SequentialMLP's ``...linear_fc1.weight``
        with the global expert index on a new leading axis (``singleton_local_shards``: one key per expert)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep = self._pg_collection.ep
        num_global = get_pg_size(ep) * self.num_gemms
        first = get_pg_rank(ep) * self.num_gemms
        axis_map = {"weight": 0, "bias": 0} if self.parallel_mode == "column" else {"weight": 1}
        out = {}
        for i in range(self.num_gemms):
            state = {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": None}
            if self.use_bias:
                state[f"{i}.bias"] = getattr(self, f"bias{i}")
            if singleton:
                expert_prefix, offsets = f"{first + i}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
            sub = make_sharded_tensors_for_checkpoint(
                state, "", {f"{i}.{k}": v for k, v in axis_map.items()}, offsets,
                tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"],
            )  # fmt: skip
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        dp_rank = get_pg_rank(self._pg_collection.expt_dp)  # replicas along the expert data-parallel group
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], dp_rank)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in={self.in_features}, out={self.out_features} (per expert, local shard), "
            f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, backend={self.fp8_backend}"
        )


class Fp8ColumnParallelGroupedLinear(Fp8GroupedLinearBase):
    """Column-parallel grouped linear (``linear_fc1`` of ``TEGroupedMLP``): output features split over expert TP."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class Fp8RowParallelGroupedLinear(Fp8GroupedLinearBase):
    """Row-parallel grouped linear (``linear_fc2`` of ``TEGroupedMLP``): input features split over expert TP."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


def grouped_mlp(recipe: BlockwiseRecipe | None = None, backend: str = "auto"):
    """Experts builder: Megatron's ``TEGroupedMLP`` with the plugin's grouped FP8 linears (no TE needed)."""
    kw = {"fp8_recipe": recipe, "fp8_backend": backend}
    sub = GroupedMLPSubmodules(linear_fc1=grouped_linear(Fp8ColumnParallelGroupedLinear, **kw),
                               linear_fc2=grouped_linear(Fp8RowParallelGroupedLinear, **kw))  # fmt: skip
    return partial(TEGroupedMLP, submodules=sub)


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

    def __init__(self, recipe: BlockwiseRecipe | None = None, backend: str = "auto", grouped: bool | None = None):
        self.recipe, self.backend, self.grouped = recipe, backend, grouped

    def __call__(self, num_local_experts, config, /, *, pg_collection=None, **kwargs):
        # kwargs: what this MoELayer passes on (``name`` from megatron-core 0.18, which older experts lack)
        grouped = self.grouped if self.grouped is not None else bool(getattr(config, "moe_grouped_gemm", False))
        build = grouped_mlp if grouped else sequential_mlp
        return build(self.recipe, self.backend)(num_local_experts, config, pg_collection=pg_collection, **kwargs)

    def __repr__(self) -> str:
        mode = {None: "by config.moe_grouped_gemm", True: "grouped", False: "sequential"}[self.grouped]
        return f"Fp8Experts({mode}, backend={self.backend})"
