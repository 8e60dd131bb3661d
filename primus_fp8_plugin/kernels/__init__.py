"""The FP8 kernels, by target: ``triton/`` (portable Triton kernels: NVIDIA, AMD gfx950, the CPU
interpreter), ``sm90/`` (Gluon kernels for NVIDIA Hopper), ``gfx950/`` (FlyDSL kernels for AMD
MI355X). Backends (``primus_fp8_plugin.backends``) compose them."""
