from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def verify_launch_hints():
    """Every hinted launch of the GPU suite recomputes Triton's full specialisation key and raises if a
    wrapper's hint stood for two specialisations (kernels/triton/launch.py)."""
    from primus_fp8_plugin.kernels.triton.launch import launch_settings

    with launch_settings(verify_hints=True):
        yield


GPU_BACKENDS = ["triton", "cublas", "hopper", "flydsl"]  # each skipped where unavailable


@pytest.fixture(params=GPU_BACKENDS)
def gpu_backend(request):
    """Every GPU backend, skipped where it cannot run (the reason in the skip)."""
    from primus_fp8_plugin import backend_availability

    avail = backend_availability(request.param, "cuda")
    if not avail:
        pytest.skip(f"{request.param}: {avail.reason}")
    return request.param


@pytest.fixture(scope="module")
def nccl_world():
    """A one-process NCCL world with Megatron's model-parallel state (TP=1) and its CUDA RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # in the worker's own block of ports (tests/conftest.py), clear of the multi-rank tests' offsets
        os.environ.setdefault("MASTER_PORT", str(int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 90))
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
