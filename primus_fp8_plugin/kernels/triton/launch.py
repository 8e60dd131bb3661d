"""Launch Triton kernels with less host work than ``kernel[grid](...)``.

``JITFunction.run`` binds the arguments by name, specialises each one, formats the compile options
into a string key, checks the kernel's globals and builds launch metadata on every call: about
25 us of Python per launch on the H200's host (docs/PERFORMANCE.md), for kernels that take a few
microseconds on the GPU. A layer's forward+backward launches three of them.

``FastLauncher`` keeps the compiled kernel per specialisation and calls its launcher directly. The
key is Triton's own specialisation of every runtime argument (``native_specialize_impl``: dtype,
16-byte alignment of pointers, int width, divisibility by 16, value 1), the constexpr values, the
launch options and the device, so a call reuses a binary only where ``JITFunction.run`` would have
picked the same one. A miss (first call of a new specialisation) goes through ``JITFunction.run``,
which compiles and launches, and the binary it returns is kept. Where Triton's launch hooks are set
(profilers such as proton use them) every call takes the ordinary path.

Computing that key is itself most of the remaining cost where a kernel takes many arguments (the
GEMM: 24, five of them tensor descriptors whose specialisation formats their layout into a string;
~40 us per launch on the H200's host under cProfile). ``FastLauncher.hinted`` lets a wrapper that knows which of
its arguments can vary name them in a short ``hint`` tuple instead; the binary is found once per
hint through the full key.

Arguments are passed positionally in the kernel's signature order, constexprs included.

Switches (``LaunchSettings``, for every launcher of the process at once: the launchers are module-level
objects of the kernel modules): ``fast=False`` sends every call the ordinary way; ``hints=False`` makes
hinted calls take the full key; ``verify_hints=True`` recomputes the full key on every hinted call and
raises if a hint ever stands for two specialisations (the GPU tests run so). ``launch_settings(...)``
changes them inside a ``with`` block; the defaults are the production path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class LaunchSettings:
    """How ``FastLauncher`` launches (module docstring): ``fast`` (the compiled handle, keyed on Triton's
    specialisation), ``hints`` (hinted calls keyed on their hint), ``verify_hints`` (check every hint)."""

    fast: bool = True
    hints: bool = True
    verify_hints: bool = False


@contextlib.contextmanager
def launch_settings(**changes) -> Iterator[LaunchSettings]:
    """Inside the ``with`` block every launcher runs with ``changes`` (``LaunchSettings`` fields) applied to
    the current settings; they are restored after it."""
    before = FastLauncher.settings
    FastLauncher.settings = dataclasses.replace(before, **changes)
    try:
        yield FastLauncher.settings
    finally:
        FastLauncher.settings = before


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is installed (triton 3.6 keeps empty ``HookChain`` objects there;
    older versions keep None or a function)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def int_class(v: int) -> int:
    """What Triton's specialisation of an int argument depends on, for launch hints: 1 for the value 1,
    16 for a multiple of 16, 0 otherwise; plus 2 where the value needs 64 signed bits, plus 4 where it
    needs 64 unsigned bits (Triton's ``i32`` / ``i64`` / ``u64``). Bools (Triton's ``u1``) and values
    outside 64 bits raise: no wrapper passes them as ints."""
    if isinstance(v, bool) or not -(2**63) <= v < 2**64:
        raise TypeError(f"int_class takes an int within 64 bits, got {v!r}")
    cls = 1 if v == 1 else (16 if v % 16 == 0 else 0)
    if -(2**31) <= v < 2**31:
        return cls
    return cls + (2 if v < 2**63 else 4)


def aligned(*tensors) -> tuple:
    """What Triton's specialisation of pointer arguments depends on, for launch hints: whether each
    tensor's data is 16-byte aligned (None for an absent tensor)."""
    return tuple(None if t is None else t.data_ptr() % 16 == 0 for t in tensors)


def _run(kernel, device: int, grid: tuple[int, ...], args: Sequence) -> None:
    """Launch a compiled kernel on the current stream (what ``JITFunction.run`` does after its lookup,
    without launch metadata: no hooks are set)."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)


class FastLauncher:
    """``launcher(grid, *args, **options)`` == ``fn[grid](*args, **options)``; ``options`` are launch
    options (``num_warps``, ``num_stages``, ``maxnreg``, ...). Works for Triton and Gluon kernels (Gluon's
    host-side ``TensorDescriptor`` arguments are specialised by Triton like any other argument)."""

    settings = LaunchSettings()  # of every launcher: ``launch_settings`` changes it

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        # under TRITON_INTERPRET=1 ``fn`` is an interpreted function: every call takes the plain path
        self._jit = isinstance(fn, JITFunction)
        params = fn.params if self._jit else []
        self._names = [p.name for p in params]
        # (position, is_const, specialize, align) of each runtime argument; positions of constexprs
        self._runtime = [
            (p.num, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            for p in params
            if not p.is_constexpr
        ]
        self._constexpr = [p.num for p in params if p.is_constexpr]
        self._compiled: dict[tuple, object] = {}
        self._hinted: dict[tuple, tuple] = {}  # (device, knobs, hint) -> (compiled kernel, full key)
        self._backend: dict[int, object] = {}  # device -> Triton backend (its specialisation rules)
        self.misses = 0  # compiled-kernel lookups that went through JITFunction.run

    def _key(self, device: int, args: Sequence, options: dict) -> tuple:
        backend = self._backend[device]
        spec = tuple(native_specialize_impl(backend, args[i], c, s, a) for i, c, s, a in self._runtime)
        # the compile options JITFunction.run adds from Triton's knobs belong to its key as well
        knob_opts = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        # constexprs by type and value: True == 1 == 1.0, but Triton compiles them apart
        constexprs = tuple((type(args[i]), args[i]) for i in self._constexpr)
        return (device, tuple(sorted(options.items())), knob_opts, spec, constexprs)

    def __call__(self, grid: tuple[int, ...], *args, **options) -> None:
        if not (self._jit and FastLauncher.settings.fast):
            self.fn[grid](*args, **options)
            return
        if len(args) != len(self._names):
            raise TypeError(f"{self.fn.__name__} takes {len(self._names)} arguments ({', '.join(self._names)}), got {len(args)}")
        device = torch.cuda.current_device()
        hooks = launch_hooks_set()
        kernel = None
        if device in self._backend and not hooks:
            key = self._key(device, args, options)
            kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **options)
            if hooks:
                return
            self.misses += 1
            if device not in self._backend:
                self._backend[device] = self.fn.device_caches[device][3]
            self._compiled[self._key(device, args, options)] = kernel
            return
        _run(kernel, device, grid, args)

    def hinted(self, hint: tuple, grid: tuple[int, ...], *args, **options) -> None:
        """``self(grid, *args, **options)`` with the binary looked up by ``hint`` instead of by Triton's
        specialisation of every argument.

        ``hint`` is the caller's promise that two calls with equal hints specialise identically: the same
        dtypes, the same 16-byte alignment of every pointer, the same ints equal to 1, divisible by 16 or
        64-bit, the same constexprs and launch options. The first call of a hint takes the full path and
        records its key; with ``LaunchSettings.verify_hints`` every call recomputes the full key and raises
        ``RuntimeError`` if it differs (a wrapper whose hint misses something that varies)."""
        settings = FastLauncher.settings
        if not (self._jit and settings.fast and settings.hints) or launch_hooks_set():
            self(grid, *args, **options)
            return
        device = torch.cuda.current_device()
        lookup = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, hint)
        entry = self._hinted.get(lookup)
        if entry is None:
            self(grid, *args, **options)  # compiles or finds the binary, and keeps it under its full key
            key = self._key(device, args, options)
            self._hinted[lookup] = (self._compiled[key], key)
            return
        kernel, key = entry
        if settings.verify_hints and self._key(device, args, options) != key:
            raise RuntimeError(
                f"{self.fn.__name__}: launch hint {hint} stands for two specialisations: it was first seen with "
                f"key {key}, now {self._key(device, args, options)}; the wrapper's hint misses an argument property"
            )
        _run(kernel, device, grid, args)
