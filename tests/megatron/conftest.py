import os

import pytest

pytest.importorskip("megatron.core")


@pytest.fixture(scope="session")
def megatron_world():
    """A one-process gloo world with Megatron's parallel state (TP=1) and the CPU stand-ins."""
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    # PRIMUS_FP8_TEST_PORT lets two checkouts run this suite side by side
    init_cpu_distributed(port=int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")))
    yield
