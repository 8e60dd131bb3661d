from __future__ import annotations

import pytest

from primus_fp8_plugin import available_backends
from primus_fp8_plugin.golden import load_linear_cases, load_quant_cases

from ..conftest import GOLDEN_DIR


def _cpu_backends() -> list[str]:
    return [name for name, avail in available_backends("cpu").items() if avail]


@pytest.fixture(params=_cpu_backends())
def backend(request) -> str:
    """Every backend that runs on this machine's CPU (the Triton interpreter counts)."""
    return request.param


@pytest.fixture(scope="session")
def quant_cases():
    return load_quant_cases(GOLDEN_DIR)[0]


@pytest.fixture(scope="session")
def linear_cases():
    return load_linear_cases(GOLDEN_DIR)[0]
