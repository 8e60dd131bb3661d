"""Gluon kernels for NVIDIA Hopper (sm_90): the dense and grouped blockwise GEMMs (built from
``gemm_library.py`` and ``schedule.py``), the quantizers and the fused quantizer; ``heuristics.py``
picks which runs a call, and where none does the portable kernels (``kernels/triton/``) run it."""
