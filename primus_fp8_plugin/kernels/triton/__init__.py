"""Portable Triton kernels (any GPU Triton targets here: NVIDIA sm_89+, AMD gfx950; and CPU tensors through
Triton's interpreter): the quantizers, the blockwise GEMMs (dense and grouped), the fused ops, the launch
path, and their configs (``heuristics.py``).

``INTERPRETED``: whether Triton builds kernels for its CPU interpreter in this process. That is Triton's
own switch, ``TRITON_INTERPRET=1``, which must be set before Triton is imported (tests/conftest.py sets
it where there is no GPU); it is read here, through Triton's knob, once, before any kernel of this
package is defined, and nowhere else in the package. Under the interpreter, ``interpreter_fix`` makes
its float conversions and NaN semantics the GPU's (exact, but slow: for tests).
"""

from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)

if INTERPRETED:
    from . import interpreter_fix

    interpreter_fix.apply()
