"""FastLauncher's host-side rules that need no GPU (its launches are checked in tests/gpu/test_gpu_launch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton import knobs

from primus_fp8_plugin.kernels.triton.launch import launch_hooks_set


def test_launch_hooks_are_seen_inside_triton_hook_chains():
    """triton 3.6 keeps (empty) HookChain objects as launch hooks: only a registered hook counts."""
    assert not launch_hooks_set()

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch_hooks_set()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch_hooks_set()


def test_a_wrong_argument_count_is_refused_before_launching(tmp_path):
    """Arguments are positional in signature order, constexprs included: a missing one must fail
    with the kernel's argument names (compiled mode, so in a process without TRITON_INTERPRET)."""
    script = tmp_path / "k.py"
    script.write_text(
        textwrap.dedent(
            """
            import triton
            import triton.language as tl
            from primus_fp8_plugin.kernels.triton.launch import FastLauncher

            @triton.jit
            def kernel(x_ptr, n, BLOCK: tl.constexpr):
                pass

            try:
                FastLauncher(kernel)((1,), None, 4, num_warps=4, num_stages=3)  # BLOCK missing
            except TypeError as e:
                print("TypeError:", e)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "TypeError: kernel takes 3 arguments (x_ptr, n, BLOCK), got 2" in proc.stdout, proc.stdout + proc.stderr


def test_int_class_separates_what_triton_specialises():
    """Launch hints name ints by ``int_class``: two ints with the same class must get the same
    specialisation from Triton (equal to 1, divisible by 16, 32 or 64 bits), checked against Triton's
    own rule on a spread of values."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from primus_fp8_plugin.kernels.triton.launch import int_class

    values = [
        0,
        1,
        2,
        4,
        15,
        16,
        17,
        32,
        48,
        100,
        4096,
        29568,
        2**31 - 16,
        2**31 - 1,
        2**31,
        2**31 + 1,
        2**31 + 16,
        2**40,
        2**63 - 1,
        2**63,
        2**63 + 16,
        2**64 - 1,
        -16,
        -1,
        -(2**31),
        -(2**31) - 1,
        -(2**31) - 16,
        -(2**63),
    ]
    by_class: dict[int, set] = {}
    for v in values:
        by_class.setdefault(int_class(v), set()).add(native_specialize_impl(BaseBackend, v, False, True, True))
    assert all(len(specs) == 1 for specs in by_class.values()), by_class
    assert len({next(iter(s)) for s in by_class.values()}) == len(by_class)  # and distinct classes differ

    for bad in (True, False, 2**64, -(2**63) - 1):  # bools are Triton's u1; past 64 bits Triton refuses
        with pytest.raises(TypeError):
            int_class(bad)


def test_aligned_names_each_pointer_as_triton_does():
    """Launch hints name pointers by ``aligned``: per tensor (two tensors misaligned in turn give
    different hints), agreeing with Triton's 16-byte rule; None stays None."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from primus_fp8_plugin.kernels.triton.launch import aligned

    buf = torch.zeros(64)
    a, b = buf[:16], buf[1:17]  # 0 and 4 bytes in
    assert aligned(a, b, None) == (True, False, None) and aligned(b, a) != aligned(a, b)
    for t in (a, b, buf[4:20]):
        assert aligned(t)[0] == (native_specialize_impl(BaseBackend, t, False, True, True)[1] == "D")
