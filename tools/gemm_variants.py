"""Launch configurations of the Hopper Gluon GEMM worth timing or compiling beside the ones the backend
picks (``gemm_gluon.select_config``), named by tile shape (BLOCK_M x BLOCK_N) and what else differs.

Used by ``tools.check_gluon_gemm --configs``, ``tools.probe_gemm_clocks --configs``,
``tools.ncu run --impl gluon:<name>``, ``benchmarks/bench_gemm.py --gluon-configs`` and
``tools.aot_triton --gluon gemm --all-configs``.
"""

from __future__ import annotations

from primus_fp8_plugin.backends.triton.gemm_gluon import TALL_CONFIG, WIDE_CONFIG, GluonGemmConfig

VARIANTS: dict[str, GluonGemmConfig] = {
    "n128_s4": GluonGemmConfig(block_n=128, num_stages=4),
    "n128_g16": GluonGemmConfig(block_n=128, group_m=16),
    "n64": GluonGemmConfig(block_n=64),
    "n128": GluonGemmConfig(),
    # 128x256 tiles, four n64 chains per K block (what select_config picks)
    "n256": WIDE_CONFIG,
    # 256x128 tiles, 1x128 B only (what select_config picks for wgrad)
    "m256": TALL_CONFIG,
}
