import sys
import types

import pytest
import torch

from primus_fp8_plugin import BackendUnavailableError, available_backends, backend_availability, get_backend
from primus_fp8_plugin import backends as registry
from primus_fp8_plugin.backends.base import Availability, Backend
from primus_fp8_plugin.backends.names import BackendEntry
from primus_fp8_plugin.backends.reference import ReferenceBackend


class _GpuOnly(ReferenceBackend):
    name = "gpu_only"

    def availability(self, device):
        if device.type != "cuda":
            return Availability(False, "needs an NVIDIA Hopper GPU")
        return Availability(True)


@pytest.fixture
def fake_backends(monkeypatch):
    mod = types.ModuleType("fake_gpu_backend")
    mod.GpuOnly = _GpuOnly
    monkeypatch.setitem(sys.modules, "fake_gpu_backend", mod)
    reg = dict(registry._REGISTRY)
    reg["gpu_only"] = BackendEntry("fake_gpu_backend", "GpuOnly", auto_rank=1)
    reg["missing_dep"] = BackendEntry("no_such_module_xyz", "X", auto_rank=2)
    monkeypatch.setattr(registry, "_REGISTRY", reg)
    monkeypatch.setattr(registry, "_INSTANCES", {})
    monkeypatch.setattr(registry, "_AVAILABILITY", {})


def test_reference_is_available_everywhere():
    assert backend_availability("reference", "cpu")
    assert get_backend("reference", "cpu").name == "reference"
    assert get_backend("auto", torch.device("cpu")).name in available_backends("cpu")


def test_auto_skips_unavailable_and_reports_reasons(fake_backends):
    assert registry.backend_names()[:2] == ["gpu_only", "missing_dep"]
    assert get_backend("auto", "cpu").name == "reference"
    avail = available_backends("cpu")
    assert not avail["gpu_only"] and "Hopper" in avail["gpu_only"].reason
    assert not avail["missing_dep"] and "could not be imported" in avail["missing_dep"].reason


def test_explicit_unavailable_backend_is_a_clear_error(fake_backends):
    with pytest.raises(
        BackendUnavailableError, match=r"'gpu_only' is not available on cpu: needs an NVIDIA Hopper GPU.*reference"
    ):
        get_backend("gpu_only", "cpu")
    with pytest.raises(BackendUnavailableError, match="no_such_module_xyz"):
        get_backend("missing_dep", "cpu")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown backend 'cuda_magic'"):
        get_backend("cuda_magic")


def test_operands_on_different_devices_are_refused():
    from primus_fp8_plugin import BlockwiseFp8Tensor, QuantParams, gemm_fwd, quantize_activation, quantize_weight

    x = torch.randn(8, 128)
    xq = quantize_activation(x, QuantParams(torch.float8_e4m3fn, 1))
    wq = quantize_weight(torch.randn(128, 128), QuantParams(torch.float8_e4m3fn, 2))
    w_meta = BlockwiseFp8Tensor(
        wq.shape,
        2,
        wq.fp8_dtype,
        wq.orig_dtype,
        rowwise_data=wq.rowwise_data.to("meta"),
        rowwise_scale_inv=wq.rowwise_scale_inv.to("meta"),
    )
    with pytest.raises(ValueError, match="different devices"):
        gemm_fwd(xq, w_meta)
    with pytest.raises(ValueError, match="one device"):
        BlockwiseFp8Tensor(
            wq.shape,
            2,
            wq.fp8_dtype,
            wq.orig_dtype,
            rowwise_data=wq.rowwise_data,
            rowwise_scale_inv=wq.rowwise_scale_inv.to("meta"),
        )


class _Recorder:
    """Stands in for a backend: every operation returns (its name, the operation, the arguments)."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, op):
        return lambda *args, **kwargs: (self.name, op, *args, *kwargs.values())


def test_hopper_backend_routes_each_gemm():
    """``hopper`` holds the two backends it delegates to: Gluon (the triton backend) for fwd, dgrad,
    accumulating wgrad and quantization, cuBLAS for plain wgrad, each with the caller's arguments;
    by default its cublas backend shares its triton backend."""
    from primus_fp8_plugin.backends.hopper import HopperBackend

    hopper = HopperBackend(triton=_Recorder("triton"), cublas=_Recorder("cublas"))
    acc, bias = torch.zeros(2, 2), torch.ones(2)
    assert hopper.gemm_fwd("x", "w", bias, torch.bfloat16) == ("triton", "gemm_fwd", "x", "w", bias, torch.bfloat16)
    assert hopper.gemm_dgrad("dy", "w", torch.float16) == ("triton", "gemm_dgrad", "dy", "w", torch.float16)
    assert hopper.gemm_wgrad("dy", "x", torch.bfloat16, None) == ("cublas", "gemm_wgrad", "dy", "x", torch.bfloat16, None)
    assert hopper.gemm_wgrad("dy", "x", torch.float32, acc) == ("triton", "gemm_wgrad", "dy", "x", torch.float32, acc)
    assert hopper.quantize_act("x", "p", rowwise=True, columnwise=False) == ("triton", "quantize_act", "x", "p", True, False)
    assert hopper.quantize_weight("w", "p") == ("triton", "quantize_weight", "w", "p")
    plain = HopperBackend()
    assert plain.cublas.triton is plain.triton


def test_cublas_backend_hands_what_cublas_cannot_take_to_its_triton_backend():
    """E5M2 operands and dims that are not multiples of 16 go to the held triton backend's GEMMs, as
    do both quantizations; nothing reaches cuBLAS (which a CPU machine does not have)."""
    from types import SimpleNamespace

    from primus_fp8_plugin.backends.cublas import CublasBackend

    cublas = CublasBackend(triton=_Recorder("triton"))
    e5 = SimpleNamespace(shape=(128, 128), fp8_dtype=torch.float8_e5m2)
    e4 = SimpleNamespace(shape=(128, 128), fp8_dtype=torch.float8_e4m3fn)
    ragged = SimpleNamespace(shape=(130, 128), fp8_dtype=torch.float8_e4m3fn)
    assert cublas.gemm_fwd(e5, e4, None, torch.bfloat16) == ("triton", "gemm_fwd", e5, e4, None, torch.bfloat16)
    assert cublas.gemm_dgrad(ragged, e4, torch.bfloat16) == ("triton", "gemm_dgrad", ragged, e4, torch.bfloat16)
    wgrad = cublas.gemm_wgrad(ragged, ragged, torch.float32, None)  # M = 130
    assert wgrad == ("triton", "gemm_wgrad", ragged, ragged, torch.float32, None)
    assert cublas.quantize_weight("w", "p") == ("triton", "quantize_weight", "w", "p")


def test_hopper_backend_needs_hopper_and_comes_first():
    avail = backend_availability("hopper", "cpu")
    assert not avail and "GPU" in avail.reason
    names = registry.backend_names()
    assert names.index("hopper") < names.index("cublas") < names.index("triton")  # auto's order on Hopper


def test_every_named_backend_resolves_to_its_class():
    """``names.BACKENDS`` is the one list (the registry and the config schema read it): each entry
    names a module and a Backend class whose ``name`` is the entry's key, and the schema accepts
    exactly ``auto`` and these names, in ``auto`` order."""
    import importlib

    from primus_fp8_plugin.backends import names
    from primus_fp8_plugin.config.schema import BACKENDS

    for name, entry in names.BACKENDS.items():
        try:
            module = importlib.import_module(entry.module)
        except ImportError:  # an optional dependency of that backend (flydsl, triton) is missing here
            continue
        cls = getattr(module, entry.cls)
        assert issubclass(cls, Backend) and cls.name == name, (name, entry)
    assert BACKENDS == ("auto", *names.backend_names()) == ("auto", *registry.backend_names())


def test_the_names_table_imports_no_torch():
    """backends/names.py is plain data: loaded on its own it brings no torch."""
    import subprocess
    import sys
    from pathlib import Path

    from primus_fp8_plugin.backends import names

    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('names', {str(Path(names.__file__))!r}); "
        "m = sys.modules['names'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(m.backend_names())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() and "reference" in proc.stdout


def test_composed_backends_hand_fused_and_grouped_ops_to_their_triton_backend():
    """hopper, cublas and flydsl hold a triton backend and must run every fused and grouped op
    through it (the class decorator), with the arguments unchanged."""
    from primus_fp8_plugin.backends.base import FUSED_OPS, GROUPED_OPS
    from primus_fp8_plugin.backends.cublas import CublasBackend
    from primus_fp8_plugin.backends.flydsl import FlydslBackend
    from primus_fp8_plugin.backends.hopper import HopperBackend

    class Recorder:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args, kwargs)

    for cls in (HopperBackend, CublasBackend, FlydslBackend):
        backend = object.__new__(cls)  # no device or toolchain probing: only the delegation is tested
        backend.triton = Recorder()
        for op in FUSED_OPS + GROUPED_OPS:
            assert getattr(backend, op)(1, "two", three=3) == (op, (1, "two"), {"three": 3}), (cls.__name__, op)
