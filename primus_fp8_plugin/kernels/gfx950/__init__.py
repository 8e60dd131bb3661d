"""FlyDSL kernels for AMD MI355X (gfx950), compile-verified (docs/AMD.md): the direct-load blockwise GEMM
(``gemm.py``) and the LDS-staged GEMMs on preshuffled weights (``gemm_lds.py``); ``heuristics.py`` picks
which runs a call. FlyDSL is imported only when a kernel is built."""
