"""The FP8 kernels, by target: ``triton/`` (portable Triton kernels: NVIDIA, AMD gfx950, the CPU
interpreter), ``sm90/`` (Gluon kernels for NVIDIA Hopper), ``gfx950/`` (FlyDSL kernels for AMD MI355X).

Each target has one ``heuristics.py`` that alone picks the kernel and the config of a call; each kernel
states once what it takes, and the heuristics consult it. Kernels take no decisions and read no
environment variable. The backends (``primus_fp8_plugin.backends``) ask the heuristics, then run the
kernel they name.
"""
