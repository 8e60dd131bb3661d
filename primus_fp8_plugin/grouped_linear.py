"""The grouped (mixture-of-experts) FP8 linear: ``E`` experts' linears on their permuted tokens at once.

Forward:  X [T, K] (expert 0's tokens first; ``m_splits`` tokens per expert) --grouped quantization (rowwise
          for the GEMM, padded columnwise kept for wgrad)--> Y_e = X_e W_e^T (+ b_e), one grouped GEMM
          W_0..W_{E-1} --grouped weight cache (all experts' W and W^T, one batched quantization per change)
Saved:    X's padded columnwise FP8 copy and its scales, the cached quantized weights. Never the high-precision X.
Backward: dY --grouped quantization--> dX_e = dY_e W_e (W^T copies), dW_e = dY_e^T X_e, or ``main_grad_e +=`` in
          fp32 when the weights have a ``main_grad`` (through a table of their addresses: Megatron's buffers need
          not be adjacent); db_e = sum of dY_e over rows.

Every result equals, bit for bit, running the plugin's dense ``fp8_blockwise_linear`` on each expert's
tokens with the same backend's kernels (the reference backend's grouped operations are exactly that loop).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .backends import Backend, get_backend
from .grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight, GroupLayout, group_layout
from .linear import _keeps_graph
from .recipe import BlockwiseRecipe, QuantParams, TensorRole
from .tensor import HIGH_PRECISION_DTYPES
from .weight_cache import CHECK_ENV, StaleWeightCacheError, _capturing, _same_bits, weight_epoch

_deref = weakref.ref.__call__
_version_of = operator.attrgetter("_version")
_storage_of = operator.methodcaller("untyped_storage")
_cdata_of = operator.attrgetter("_cdata")
_ptr_of = operator.methodcaller("data_ptr")
_stride_of = operator.methodcaller("stride")
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")


class GroupedWeightCache:
    """The quantized copies (W and W^T, stacked) of ``E`` expert weights, valid while no weight changed.

    It serves the stored copies only under the guarantees of the dense ``WeightCache`` (``weight_cache.py``),
    checked for every expert: the same tensor objects (weak references: a new tensor at a freed address never
    matches) over the same storage objects (weak storage references), the same data pointers (hence storage
    offsets), strides, shapes and dtypes, unchanged version counters (in-place writes, ``load_state_dict``), the same
    quantization parameters and backend, and no optimizer step or ``mark_weights_changed`` since (the
    process-wide weight epoch); ``refresh=True`` always re-makes. Otherwise all experts' copies are re-made by
    one batched quantization into new stacked buffers (the old ones are released first, so that a refresh
    does not hold two copies). Under CUDA-graph capture, ``torch.compile`` tracing, and for inference tensors
    inside inference mode it quantizes on every call and trusts nothing it made there afterwards.

    Cost per call when nothing changed: a fixed number of C-level passes over the ``E`` weights (``map`` with
    ``operator`` getters: about 0.3 us per expert on a CPU) and no per-expert Python code.
    ``PRIMUS_FP8_CHECK_WEIGHT_CACHE=1`` (or ``check=True``) compares every served copy with a fresh one.
    """

    def __init__(self, *, check: bool | None = None) -> None:
        self._value: GroupedFp8Weight | None = None
        self._refs: list | None = None
        self._storage_refs: list | None = None
        self._key: tuple | None = None
        self.check = os.environ.get(CHECK_ENV, "0") == "1" if check is None else bool(check)
        self.refreshes = 0  # batched quantizations made (for tests and logs)
        self.checks = 0

    @staticmethod
    def _key_of(weights: Sequence[torch.Tensor], params: QuantParams, backend: Backend) -> tuple[tuple, list]:
        """(the key, the weights' storages); each part of the key is one C-level pass over the weights."""
        storages = list(map(_storage_of, weights))
        try:
            versions = tuple(map(_version_of, weights))
        except RuntimeError:  # inference tensors have no version counter (none changes outside inference mode)
            versions = tuple(-1 if w.is_inference() else w._version for w in weights)
        return (
            versions,
            weight_epoch(),
            params,
            backend,
            tuple(map(_cdata_of, storages)),
            tuple(map(_ptr_of, weights)),  # with the storage and the dtype, this fixes the storage offset
            tuple(map(_stride_of, weights)),
            tuple(map(_shape_of, weights)),
            tuple(map(_dtype_of, weights)),
        ), storages

    def _holds(self, weights: Sequence[torch.Tensor], key: tuple) -> bool:
        refs = self._refs
        return (
            refs is not None
            and len(refs) == len(weights)
            and all(map(operator.is_, map(_deref, refs), weights))
            and key == self._key
        )

    def get(
        self, weights: Sequence[torch.Tensor], params: QuantParams, backend: Backend, *, refresh: bool = False
    ) -> GroupedFp8Weight:
        """All experts' quantized copies, re-made (in one launch) unless every weight is provably unchanged."""
        untracked = torch.is_inference_mode_enabled() and any(w.is_inference() for w in weights)
        if untracked or _capturing() or torch.compiler.is_compiling():
            _check_weights(weights, weights[0].device)
            self.invalidate()  # an entry made here is never served by key (weight_cache.py)
            self.refreshes += 1
            self._value = self._quantize(weights, params, backend)
            return self._value
        key, storages = self._key_of(weights, params, backend)
        if not refresh and self._holds(weights, key):
            if self.check:
                self._check(weights, params, backend)
            return self._value
        _check_weights(weights, weights[0].device)
        self.invalidate()  # release the old buffers before allocating the new ones
        self._value = self._quantize(weights, params, backend)
        self._refs = [weakref.ref(w) for w in weights]
        self._storage_refs = [StorageWeakRef(s) for s in storages]
        self._key = key
        self.refreshes += 1
        return self._value

    @staticmethod
    def _quantize(weights, params: QuantParams, backend: Backend) -> GroupedFp8Weight:
        with torch.no_grad():
            return backend.quantize_weight_grouped([w.detach().contiguous() for w in weights], params)

    def _check(self, weights, params, backend) -> None:
        self.checks += 1
        fresh, held = self._quantize(weights, params, backend), self._value
        for e in range(len(weights)):
            if not _same_bits(fresh.expert(e), held.expert(e)):
                raise StaleWeightCacheError(
                    f"the grouped weight cache was about to serve a stale FP8 copy of expert {e}'s weight "
                    f"{list(weights[e].shape)}: its values changed without a version-counter bump (a write through "
                    ".data, through another tensor sharing its storage, or by a collective) and outside an optimizer "
                    "step. After such a write call invalidate() (invalidate_weight_cache() on the layer) or "
                    "primus_fp8_plugin.weight_cache.mark_weights_changed()."
                )

    def __getstate__(self) -> dict:
        # copies and pickles start empty (their weights are other tensors; storage weak references must never
        # be duplicated)
        return {"check": self.check}

    def __setstate__(self, state: dict) -> None:
        self.__init__(check=state["check"])

    def invalidate(self) -> None:
        """Drop the cached copies; the next ``get`` re-quantizes."""
        self._value = self._refs = self._storage_refs = self._key = None

    @property
    def nbytes(self) -> int:
        return 0 if self._value is None else self._value.nbytes


def _check_weights(weights, device: torch.device) -> None:
    """Every expert weight 2-D, of weight 0's shape, on ``device`` (one C-level pass per property; the loop over
    the experts runs only to name the first wrong one)."""
    w0 = weights[0]
    if w0.dim() == 2 and set(map(_shape_of, weights)) == {w0.shape} and set(map(_device_of, weights)) == {device}:
        return
    n, k = w0.shape if w0.dim() == 2 else (w0.shape[0] if w0.dim() else None, None)
    for i, w in enumerate(weights):
        if w.dim() != 2 or tuple(w.shape) != (n, k) or w.device != device:
            raise ValueError(f"weight {i} is {tuple(w.shape)} on {w.device}: each expert needs a [{n}, {k}] weight on {device}")


def _check_inputs(x, weights, biases, *, each_weight: bool = True) -> None:
    """The input, the weights and the biases. ``each_weight=False`` checks only weight 0 against ``x``: for a call
    with a ``GroupedWeightCache``, which checks every weight (``_check_weights``) whenever it re-quantizes and serves
    its copies only while every weight's shape, dtype and storage (hence device) are the ones it checked."""
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"input has dtype {x.dtype}; the FP8 grouped linear takes bfloat16, float16 or float32")
    if not weights:
        raise ValueError("a grouped linear needs at least one expert weight")
    _check_weights(weights if each_weight else weights[:1], x.device)
    n, k = weights[0].shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"input's last dim is {x.shape[-1] if x.dim() else None} but in_features is {k}")
    if biases is not None:
        if (
            len(biases) != len(weights)
            or any(map(operator.is_, biases, itertools.repeat(None)))
            or set(map(_shape_of, biases)) != {torch.Size((n,))}
            or set(map(_device_of, biases)) != {x.device}
        ):
            raise ValueError(f"biases must be one [{n}] tensor on {x.device} per expert ({len(weights)})")


def _layout_of(m_splits, x2d: torch.Tensor, num_groups: int) -> GroupLayout:
    layout = m_splits if isinstance(m_splits, GroupLayout) else group_layout(m_splits, x2d.shape[0], x2d.device)
    if layout.num_groups != num_groups or layout.num_tokens != x2d.shape[0]:
        raise ValueError(f"m_splits describe {layout.num_groups} experts and {layout.num_tokens} tokens; the layer has "
                         f"{num_groups} experts and the input {x2d.shape[0]} tokens")  # fmt: skip
    return layout


class _Fp8GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, recipe, backend, cache, refresh_cache, num_groups, has_bias, *params):
        weights, biases = params[:num_groups], params[num_groups:]
        n, k = weights[0].shape
        lead = x.shape[:-1]
        x2d = x.reshape(-1, k)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        need_wgrad = any(w.requires_grad for w in weights)
        xq = backend.quantize_act_grouped(x2d, layout, recipe.params(TensorRole.INPUT), rowwise=True, columnwise=need_wgrad)
        p_w = recipe.params(TensorRole.WEIGHT)
        if cache is not None:
            wq = cache.get(weights, p_w, backend, refresh=refresh_cache)
        else:
            with torch.no_grad():
                wq = backend.quantize_weight_grouped([w.detach().contiguous() for w in weights], p_w)
        bias = torch.stack([b.detach() for b in biases]) if has_bias else None
        y = backend.gemm_fwd_grouped(xq, wq, bias, x.dtype)

        if need_wgrad:  # keep only what wgrad reads: X's columnwise copy
            ctx.save_for_backward(xq.columnwise_data, xq.columnwise_scale_inv)
        else:
            ctx.save_for_backward(None, None)
        ctx.weights = weights  # on ctx, not saved: linear.keep_weight says why (main_grad under saved-tensor hooks)
        ctx.x_meta = (tuple(xq.shape), xq.fp8_dtype, x.dtype, lead)
        ctx.layout, ctx.wq, ctx.recipe, ctx.backend = layout, wq, recipe, backend
        ctx.num_groups, ctx.has_bias = num_groups, has_bias
        return y.view(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        x_col, x_col_scale = ctx.saved_tensors
        weights = ctx.weights
        (t, k), x_fp8, x_dtype, lead = ctx.x_meta
        e, n = ctx.num_groups, weights[0].shape[0]
        backend: Backend = ctx.backend
        need = ctx.needs_input_grad
        need_dx = need[0]
        need_dw = [need[8 + i] for i in range(e)]
        need_db = [need[8 + e + i] for i in range(e)] if ctx.has_bias else []
        dy2d = dy.reshape(-1, n)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        p_g = ctx.recipe.params(TensorRole.GRAD_OUTPUT)
        dyq = backend.quantize_act_grouped(dy2d, ctx.layout, p_g, rowwise=need_dx, columnwise=any(need_dw))
        dx = backend.gemm_dgrad_grouped(dyq, ctx.wq, x_dtype).view(*lead, k) if need_dx else None
        dws = [None] * e
        if any(need_dw):
            xq = GroupedFp8Tensor(ctx.layout, (t, k), x_fp8, x_dtype, columnwise_data=x_col, columnwise_scale_inv=x_col_scale)
            dws = _weight_grads(backend, dyq, xq, weights, need_dw)
        dbs = [None] * len(need_db)
        if any(need_db):
            # the dense layer's bias gradient per expert: a sum of its rows of dY in dY's dtype (reads the counts)
            parts = torch.split(dy2d, ctx.layout.counts_list())
            dbs = [p.sum(0) if nd else None for p, nd in zip(parts, need_db)]
        if not _keeps_graph():
            ctx.wq = None  # the graph is freed after this backward: so is the quantized weight
        return dx, None, None, None, None, None, None, None, *dws, *dbs


def _weight_grads(backend: Backend, dyq, xq, weights, need_dw) -> list:
    """Per expert: the weight gradient, or (Megatron's gradient-accumulation fusion, where every weight has a
    ``main_grad``) ``main_grad += dW`` in fp32 and a dummy gradient so that the parameters' hooks still run."""
    fused = [getattr(w, "main_grad", None) is not None and getattr(w, "fuse_wgrad_accumulation", True) for w in weights]
    if not any(fused):
        dws = backend.gemm_wgrad_grouped(dyq, xq, weights[0].dtype, None)
        return [d if nd else None for d, nd in zip(dws, need_dw)]
    if not all(fused):
        raise ValueError("either every expert weight has a main_grad (with fuse_wgrad_accumulation) or none has")
    for i, w in enumerate(weights):
        mg = w.main_grad
        if mg.dtype != torch.float32 or mg.shape != w.shape or not mg.is_contiguous():
            raise ValueError(
                f"weight {i}'s main_grad must be a contiguous float32 tensor of the weight's shape {tuple(w.shape)}, got "
                f"{mg.dtype} {tuple(mg.shape)} (contiguous={mg.is_contiguous()}); set fuse_wgrad_accumulation = False on "
                "the weights to get the gradients in .grad instead"
            )
    backend.gemm_wgrad_grouped(dyq, xq, torch.float32, [w.main_grad for w in weights])
    out = []
    for w in weights:
        dummy = _dummy_wgrad(w) if hasattr(w, "grad_added_to_main_grad") else None
        w.grad_added_to_main_grad = True
        out.append(dummy)
    return out


_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def _dummy_wgrad(w: torch.Tensor) -> torch.Tensor:
    """The placeholder gradient returned for a weight whose gradient went into its ``main_grad`` (so that the
    parameter's hooks run; Megatron's hook discards it): one tensor per shape, dtype and device, shared by all
    experts and calls (zeros where the weight asks ``zero_out_wgrad``), instead of ``E`` weight-sized tensors
    alive at once. Autograd copies it into each ``.grad`` it sets, one expert at a time; nothing writes it."""
    zero = bool(getattr(w, "zero_out_wgrad", False))
    key = (tuple(w.shape), w.dtype, w.device, zero)
    dummy = _DUMMY_WGRADS.get(key)
    if dummy is None:
        dummy = (torch.zeros if zero else torch.empty)(w.shape, dtype=w.dtype, device=w.device)
        _DUMMY_WGRADS[key] = dummy
    return dummy


def fp8_grouped_linear(
    x: torch.Tensor,
    m_splits: GroupLayout | torch.Tensor | Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None = None,
    *,
    recipe: BlockwiseRecipe | None = None,
    backend: str | Backend = "auto",
    weight_cache: GroupedWeightCache | None = None,
    refresh_weight_cache: bool = False,
) -> torch.Tensor:
    """``y_e = x_e W_e^T + b_e`` for each expert's tokens, with FP8 blockwise GEMMs forward and backward.

    Args:
        x: ``[..., in_features]`` bfloat16/float16/float32; the flattened rows are the permuted tokens.
        m_splits: tokens per expert: a list of ints (checked), an integer device tensor ``[E]`` (no host
            synchronisation in the kernels; biases' gradients read it on the host), or a ``GroupLayout``.
        weights: ``E`` tensors ``[out_features, in_features]``; with a ``main_grad`` on every one (Megatron),
            the weight gradients are accumulated into them in fp32.
        biases: ``E`` tensors ``[out_features]`` or None.
        recipe, backend, weight_cache, refresh_weight_cache: as for ``fp8_blockwise_linear`` (the cache is a
            ``GroupedWeightCache``).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.
    """
    weights = list(weights)
    biases = None if biases is None else list(biases)
    _check_inputs(x, weights, biases, each_weight=weight_cache is None)
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    layout = _layout_of(m_splits, x.reshape(-1, x.shape[-1]), len(weights))
    params = weights + (biases or [])
    return _Fp8GroupedLinearFn.apply(x, layout, recipe or BlockwiseRecipe(), impl, weight_cache, refresh_weight_cache,
                                     len(weights), biases is not None, *params)  # fmt: skip


class Fp8GroupedLinear(nn.Module):
    """``num_gemms`` experts' linears (``y_e = x_e W_e^T + b_e``) on permuted tokens, with TE ``Float8BlockScaling``
    numerics; parameters ``weight0..``, ``bias0..`` as in TE's ``GroupedLinear``.

    Args:
        num_gemms: number of experts ``E``.
        in_features, out_features, bias, device, dtype: per expert, as for ``torch.nn.Linear``.
        recipe, backend, cache_weight: as for ``Fp8BlockwiseLinear`` (the cache holds all experts' W and W^T).

    ``forward(x, m_splits)``: ``x [T, in_features]`` (or ``[..., in_features]``), ``m_splits`` the tokens per
    expert (a list, an integer device tensor, or a ``GroupLayout``). ``is_first_microbatch`` as for
    ``Fp8BlockwiseLinear``.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: BlockwiseRecipe | None = None,
        backend: str = "auto",
        cache_weight: bool = True,
    ) -> None:
        super().__init__()
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be >= 1, got {num_gemms}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        make = lambda *shape: nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))  # noqa: E731
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", make(out_features, in_features))
            self.register_parameter(f"bias{i}", make(out_features) if bias else None)
        self.recipe = recipe or BlockwiseRecipe()
        self.backend = backend
        if backend != "auto":
            get_backend(backend, self.weight0.device if self.weight0.device.type != "meta" else None)
        self._weight_cache = GroupedWeightCache() if cache_weight else None
        self.is_first_microbatch: bool | None = None
        self.reset_parameters()

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> list[nn.Parameter] | None:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for every expert."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
        for i in range(self.num_gemms):
            nn.init.kaiming_uniform_(getattr(self, f"weight{i}"), a=math.sqrt(5))
            if self.use_bias:
                nn.init.uniform_(getattr(self, f"bias{i}"), -bound, bound)

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        refresh = bool(self.is_first_microbatch)
        y = fp8_grouped_linear(
            x, m_splits, self.weights, self.biases, recipe=self.recipe, backend=self.backend,
            weight_cache=self._weight_cache, refresh_weight_cache=refresh,
        )  # fmt: skip
        if refresh:
            self.is_first_microbatch = False
        return y

    def invalidate_weight_cache(self) -> None:
        """Forget the quantized weights (needed only after writing a weight through ``.data``)."""
        if self._weight_cache is not None:
            self._weight_cache.invalidate()

    @property
    def weight_cache_nbytes(self) -> int:
        return 0 if self._weight_cache is None else self._weight_cache.nbytes

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_weight_cache()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, fp8={self.recipe.fp8_format.value}, backend={self.backend}"
        )
