"""The plugin's linear captured in a CUDA graph, forward and backward together (what Megatron's per-layer
graphs and whole-step graphs capture): every replay, after optimizer steps that change the weight, gives
bit for bit what the same layer computes eagerly from the same weights and inputs. The weight cache
quantizes inside the graph (weight_cache.py), so a replay never reads the copy of the capture step."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, backend_availability

from ..conftest import make_input

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["triton", "cublas", "hopper", "flydsl"])  # each skipped where unavailable
def gpu_backend(request):
    avail = backend_availability(request.param, "cuda")
    if not avail:
        pytest.skip(f"{request.param}: {avail.reason}")
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} elements differ from eager"


def _capture(step_fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Warm ``step_fn`` up on a side stream (kernels compile there), then capture one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step_fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_fn()
    return graph


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_forward_backward_graph_replays_bit_for_bit_after_optimizer_steps(gpu_backend, fmt):
    torch.manual_seed(0)
    m, k, n = 200, 512, 384  # M not a multiple of 128: partial tiles in every quantization
    kw = dict(bias=True, device="cuda", dtype=torch.bfloat16, recipe=BlockwiseRecipe(fp8_format=fmt), backend=gpu_backend)
    graphed, eager = Fp8BlockwiseLinear(k, n, **kw), Fp8BlockwiseLinear(k, n, **kw)
    eager.load_state_dict(graphed.state_dict())
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    static_x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    out = {}

    def step():
        # gradients are overwritten, not accumulated: None before each call (as zero_grad(set_to_none))
        graphed.weight.grad = graphed.bias.grad = static_x.grad = None
        out["y"] = graphed(static_x)
        out["y"].backward(static_dy)

    graph = _capture(step)
    for i in range(4):
        x = make_input((m, k), seed=10 + i).cuda()
        dy = make_input((m, n), seed=20 + i).cuda()
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        graph.replay()
        xe = x.clone().requires_grad_(True)
        eager.zero_grad(set_to_none=True)
        ye = eager(xe)
        ye.backward(dy)
        what = f"{gpu_backend} {fmt} replay {i}"
        assert_same(out["y"], ye, f"{what}: output")
        assert_same(static_x.grad, xe.grad, f"{what}: input gradient")
        assert_same(graphed.weight.grad, eager.weight.grad, f"{what}: weight gradient")
        assert_same(graphed.bias.grad, eager.bias.grad, f"{what}: bias gradient")
        opt_g.step()  # reads the graph's static gradients; the next replay must see the new weight
        opt_e.step()
        assert_same(graphed.weight, eager.weight, f"{what}: weight after the optimizer step")


def test_main_grad_accumulation_in_a_graph_matches_eager(gpu_backend):
    """Megatron's gradient-accumulation fusion inside the graph: ``main_grad += dW`` in fp32 on every
    replay (two microbatches per step), then the optimizer step, as eager does."""
    torch.manual_seed(1)
    m, k, n = 256, 384, 640
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16, backend=gpu_backend)
    graphed, eager = Fp8BlockwiseLinear(k, n, **kw), Fp8BlockwiseLinear(k, n, **kw)
    eager.load_state_dict(graphed.state_dict())
    for layer in (graphed, eager):
        layer.weight.main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    static_x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        static_x.grad = None
        graphed(static_x).backward(static_dy)

    graph = _capture(step)
    for s in range(3):
        for layer in (graphed, eager):
            layer.weight.main_grad.zero_()
        for mb in range(2):
            x = make_input((m, k), seed=100 * s + mb).cuda()
            dy = make_input((m, n), seed=100 * s + mb + 50).cuda()
            with torch.no_grad():
                static_x.copy_(x)
                static_dy.copy_(dy)
            graph.replay()
            xe = x.clone().requires_grad_(True)
            eager(xe).backward(dy)
            assert_same(static_x.grad, xe.grad, f"{gpu_backend} step {s} microbatch {mb}: input gradient")
        assert_same(graphed.weight.main_grad, eager.weight.main_grad, f"{gpu_backend} step {s}: main_grad")
        with torch.no_grad():  # an optimizer step on the bf16 weights from the fp32 main_grad
            for layer in (graphed, eager):
                layer.weight.sub_(0.01 * layer.weight.main_grad.to(torch.bfloat16))
        assert_same(graphed.weight, eager.weight, f"{gpu_backend} step {s}: weight")
