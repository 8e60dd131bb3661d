"""Gluon kernels for NVIDIA Hopper (sm_90)."""
