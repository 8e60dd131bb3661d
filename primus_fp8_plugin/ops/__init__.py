"""The FP8 linear ops: one autograd core (``core.py``) with its input stages (``stages.py``), token exchanges
(``exchange.py``) and layouts (``layouts.py``); the public functional forms are in ``api.py``."""

from .api import (
    fp8_blockwise_linear,
    fp8_grouped_linear,
    fp8_grouped_swiglu_linear,
    fp8_norm_linear,
    fp8_swiglu_linear,
    mark_saved_elsewhere,
)
from .exchange import gather_rows

__all__ = [
    "fp8_blockwise_linear",
    "fp8_grouped_linear",
    "fp8_grouped_swiglu_linear",
    "fp8_norm_linear",
    "fp8_swiglu_linear",
    "gather_rows",
    "mark_saved_elsewhere",
]
