"""Portable Triton kernels: quantizers, blockwise GEMMs (dense and grouped), fused ops, launch."""
