"""Counting the host work of a call: how many Python-level functions it runs (``sys.setprofile``'s "call" events;
C functions such as ``map`` and ``operator`` getters report "c_call" instead). Counted, not timed: the count does
not depend on the machine's load.

Not counted: what runs inside Triton (under ``TRITON_INTERPRET=1`` the interpreter runs each kernel program in
Python on the CPU, the work a GPU does: on a GPU a launch is one call into Triton's compiled launcher), and the
generator over its inputs that torch's ``autograd.Function.apply`` runs (``torch._functorch.utils.
unwrap_dead_wrappers``: one resumption per input tensor, so per expert weight, in torch's own code, which every
op taking ``E`` weights as autograd inputs pays, TE's ``GroupedLinear`` too)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import torch

_triton = importlib.util.find_spec("triton")  # absent where only the reference backend is installed
TRITON = str(Path(_triton.origin).resolve().parent) if _triton is not None else "<no triton>"
TORCH_APPLY_INPUTS = (str(Path(torch.__file__).resolve().parent / "_functorch" / "utils.py"), "<genexpr>")


def python_calls(fn, where: Counter | None = None) -> int:
    """Python-level calls ``fn()`` makes (module docstring); ``where`` counts them by ``(file, function)``."""
    calls, inside = 0, None

    def count(frame, event, arg):
        nonlocal calls, inside
        if inside is not None:  # within a Triton call: skipped until it returns
            if event == "return" and frame is inside:
                inside = None
            return
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(TRITON):
            inside = frame
            return
        if (code.co_filename, code.co_name) == TORCH_APPLY_INPUTS:
            return
        calls += 1
        if where is not None:
            where[(code.co_filename, code.co_name)] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
