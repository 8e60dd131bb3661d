"""Launch configurations of the Hopper Gluon GEMM worth timing or compiling beside the ones the backend
picks (``kernels/sm90/heuristics.gemm_config``), named by tile shape (BLOCK_M x BLOCK_N) and what else differs
(``_s4``: 4 pipeline stages instead of as many as fit; ``_g16``: GROUP_M = 16 instead of 8).

Used by ``tools.check_gluon_gemm --configs``, ``tools.probe_gemm_clocks --configs``,
``tools.ncu run --impl gluon:<name>``, ``benchmarks/bench_gemm.py --gluon-configs`` and
``tools.aot_triton --gluon gemm --all-configs``.
"""

from __future__ import annotations

from primus_fp8_plugin.kernels.sm90.gemm import GluonGemmConfig
from primus_fp8_plugin.kernels.sm90.heuristics import CONFIG_128x128, CONFIG_128x256, CONFIG_256x128

VARIANTS: dict[str, GluonGemmConfig] = {
    "128x128": CONFIG_128x128,
    "128x128_s4": GluonGemmConfig(num_stages=4),
    "128x128_g16": GluonGemmConfig(group_m=16),
    "128x64": GluonGemmConfig(block_n=64),
    "128x256": CONFIG_128x256,  # what gemm_config picks for 128x128-scaled B (fwd, dgrad)
    "256x128": CONFIG_256x128,  # 1x128-scaled B only; what gemm_config picks for wgrad
}
