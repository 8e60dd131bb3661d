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


@pytest.fixture(autouse=True)
def fresh_moe_metrics():
    """Megatron's routers add their losses into a process-wide tracker sized by the first model's layer count
    (Megatron-LM's loop clears it every step): each test starts without another test's entries."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    except ImportError:  # megatron-core before 0.19: a dict of entries
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    yield
