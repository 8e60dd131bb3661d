"""The numerics contract: Transformer Engine's ``Float8BlockScaling`` recipe.

A :class:`BlockwiseRecipe` says, for each tensor role of a linear layer, which FP8 type,
which tile shape and which scale rule is used. It knows nothing of kernels or modules.

TE 2.20.2 semantics (see ``docs/NUMERICS.md``):

========================  =================  ==========  ==========
role                      tiles              E4M3        HYBRID
========================  =================  ==========  ==========
input activations X       1x128 (and 128x1)  E4M3        E4M3
weight W [N, K]           128x128            E4M3        E4M3
output gradient dY        1x128 (and 128x1)  E4M3        E5M2
========================  =================  ==========  ==========
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch

from . import env

BLOCK = 128
"""Edge of a scaling tile: 1x128 / 128x1 for 1D tiles, 128x128 for 2D tiles."""

FP32_SCALES_ENV = env.FP32_SCALES


class Fp8Format(enum.Enum):
    """FP8 formats of TE's ``Format`` that the blockwise recipe accepts (plus E5M2, to reject it)."""

    E4M3 = "E4M3"  # everything E4M3
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 output gradients
    E5M2 = "E5M2"  # pure E5M2: TE rejects it for blockwise scaling, so do we


class TensorRole(enum.Enum):
    """Which operand of a linear layer a tensor is."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


@dataclass(frozen=True)
class QuantParams:
    """How one tensor is quantized: everything a quantization kernel needs.

    Attributes:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block_dim: 1 for 1x128 tiles along the last dim (and 128x1 for the columnwise copy),
            2 for 128x128 blocks.
        pow2_scales: round each scale down to a power of two (TE's default).
        amax_epsilon: lower bound applied to each tile's amax before the scale is computed.
    """

    fp8_dtype: torch.dtype
    block_dim: int
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if self.fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}")
        if self.block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 (1x128 tiles) or 2 (128x128 blocks), got {self.block_dim}")
        _check_bool("pow2_scales", self.pow2_scales)
        if not (self.amax_epsilon >= 0.0 and self.amax_epsilon < float("inf")):
            raise ValueError(f"amax_epsilon must be finite and >= 0, got {self.amax_epsilon}")

    @property
    def fp8_max(self) -> float:
        """Largest finite value of the FP8 type (448 for E4M3, 57344 for E5M2)."""
        return float(torch.finfo(self.fp8_dtype).max)

    @property
    def tile(self) -> tuple[int, int]:
        """Tile shape of the rowwise copy: (1, 128) or (128, 128)."""
        return (1, BLOCK) if self.block_dim == 1 else (BLOCK, BLOCK)


def _check_bool(name: str, value) -> None:
    """``value`` must be a bool (or the int 0 or 1): a string such as "no" or "false" is truthy and
    would silently mean True."""
    if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _pow2_default() -> bool:
    """TE's rule: power-of-2 scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1."""
    return not env.fp32_scales()


@dataclass(frozen=True)
class BlockwiseRecipe:
    """FP8 blockwise scaling, mirroring TE's ``Float8BlockScaling``.

    Args:
        fp8_format: ``Fp8Format.E4M3`` (default) or ``Fp8Format.HYBRID`` (E5M2 output gradients).
            Strings "E4M3" / "HYBRID" are accepted.
        pow2_scales: power-of-2 scales. Defaults, as in TE, to True unless the environment
            variable ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` is set when the recipe is created.
        amax_epsilon: lower bound for each tile's amax (TE's ``QParams.amax_epsilon``), all roles.
        x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1x128 tiles) or
            2 (128x128 blocks) for inputs, weights and output gradients. TE's defaults: 1, 2, 1.

    Raises:
        ValueError: for what TE rejects: pure E5M2, tile dims other than 1 or 2, and any
            2D x 2D pairing (no GEMM exists for two 128x128-scaled operands).
        NotImplementedError: for valid TE settings this plugin has no GEMM for (2D activations
            or gradients, 1D weights).
    """

    fp8_format: Fp8Format = Fp8Format.E4M3
    pow2_scales: bool = field(default_factory=_pow2_default)
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.fp8_format, str):
            try:
                object.__setattr__(self, "fp8_format", Fp8Format(self.fp8_format.upper()))
            except ValueError:
                raise ValueError(f"unknown fp8_format {self.fp8_format!r}: use 'E4M3' or 'HYBRID'") from None
        _check_bool("pow2_scales", self.pow2_scales)
        if self.fp8_format is Fp8Format.E5M2:
            raise ValueError(
                "Pure E5M2 training is not supported by FP8 block scaling (TE rejects it too): "
                "use fp8_format='E4M3' or 'HYBRID' (E5M2 only for output gradients)"
            )
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for name, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128 blocks), got {dim}")
        pairs = [("x", "w"), ("x", "grad"), ("w", "grad")]
        for a, b in pairs:
            if dims[f"{a}_block_scaling_dim"] == 2 and dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(
                    f"2D by 2D block GEMM is not supported ({a}_block_scaling_dim=2 and "
                    f"{b}_block_scaling_dim=2): at most one operand of each GEMM may use 128x128 blocks"
                )
        if (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim) != (1, 2, 1):
            raise NotImplementedError(
                "only TE's default tiling (x 1x128, w 128x128, grad 1x128) has GEMMs in this plugin; "
                f"got x={self.x_block_scaling_dim}, w={self.w_block_scaling_dim}, "
                f"grad={self.grad_block_scaling_dim}"
            )
        # The three roles' parameters, made once (QuantParams validates amax_epsilon): params() runs
        # three times per layer call, on the host's critical path.
        grad_dtype = torch.float8_e5m2 if self.fp8_format is Fp8Format.HYBRID else torch.float8_e4m3fn
        by_role = {
            TensorRole.INPUT: QuantParams(torch.float8_e4m3fn, self.x_block_scaling_dim, self.pow2_scales, self.amax_epsilon),
            TensorRole.WEIGHT: QuantParams(torch.float8_e4m3fn, self.w_block_scaling_dim, self.pow2_scales, self.amax_epsilon),
            TensorRole.GRAD_OUTPUT: QuantParams(grad_dtype, self.grad_block_scaling_dim, self.pow2_scales, self.amax_epsilon),
        }
        object.__setattr__(self, "_params_by_role", by_role)

    def params(self, role: TensorRole) -> QuantParams:
        """The quantization parameters of one tensor role."""
        params = self._params_by_role.get(role)
        return params if params is not None else self._params_by_role[TensorRole(role)]


@functools.lru_cache(maxsize=2)
def _default_recipe(pow2_scales: bool) -> BlockwiseRecipe:
    return BlockwiseRecipe(pow2_scales=pow2_scales)


def default_recipe() -> BlockwiseRecipe:
    """``BlockwiseRecipe()`` as the environment says now, made once per setting (an op called without a recipe
    would otherwise build and validate one per call, on the host's critical path)."""
    return _default_recipe(_pow2_default())
