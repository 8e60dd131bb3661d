"""Every FP8 op under ``torch.autograd.graph.saved_tensors_hooks`` (what memory tools, activation
offloading and ``save_on_cpu`` install): the same outputs and gradients as without hooks, and a
weight's ``main_grad`` still gets the weight gradient (Megatron's gradient-accumulation fusion).

With hooks, autograd hands ``backward`` a new tensor object for every saved tensor, so Python attributes of
a saved weight (``main_grad``, ``grad_added_to_main_grad``) are not on what ``ctx.saved_tensors`` returns."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import fp8_blockwise_linear, fp8_grouped_linear, fp8_norm_linear, fp8_swiglu_linear

from .conftest import make_input

HOOKS = {
    "identity": (lambda t: t, lambda t: t),
    "clone": (lambda t: t.detach().clone(), lambda t: t),  # a copy, as offloading makes one
}


def _linear(x, ws):
    return fp8_blockwise_linear(x, ws[0], backend="reference")


def _norm_linear(x, ws):
    gamma = torch.linspace(0.5, 1.5, x.shape[-1]).bfloat16()
    return fp8_norm_linear(x, gamma, None, ws[0], normalization="RMSNorm", backend="reference")


def _swiglu_linear(x, ws):
    return fp8_swiglu_linear(torch.cat([x, x * 0.5], -1), ws[0], backend="reference")


def _grouped(x, ws):
    return fp8_grouped_linear(x, [100, 0, 60], ws, backend="reference")


OPS = {"linear": (_linear, 1), "norm_linear": (_norm_linear, 1), "swiglu_linear": (_swiglu_linear, 1), "grouped": (_grouped, 3)}


def _run(op, n_weights, hooks, megatron):
    k, n = 256, 128
    x = make_input((160, k), spread=False).requires_grad_(True)
    ws = []
    for i in range(n_weights):
        w = (make_input((n, k), seed=10 + i, spread=False) / 16).requires_grad_(True)
        w.main_grad = torch.full((n, k), 0.25)  # accumulated into, not overwritten
        if megatron:
            w.grad_added_to_main_grad = False
        ws.append(w)
    dy = make_input((160, n), seed=3, spread=False)
    if hooks is None:
        y = op(x, ws)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*HOOKS[hooks]):
            y = op(x, ws)
    y.backward(dy)
    return y.detach(), x.grad, [w.main_grad.clone() for w in ws], [w.grad for w in ws], ws


@pytest.mark.parametrize("megatron", [True, False], ids=["megatron", "main_grad_only"])
@pytest.mark.parametrize("hooks", sorted(HOOKS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_main_grad_accumulated_under_saved_tensor_hooks(name, hooks, megatron):
    op, n_weights = OPS[name]
    y0, dx0, mg0, _, _ = _run(op, n_weights, None, megatron)
    y1, dx1, mg1, grads, ws = _run(op, n_weights, hooks, megatron)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for i, (a, b) in enumerate(zip(mg0, mg1)):
        assert not torch.equal(b, torch.full_like(b, 0.25)) or name == "grouped" and i == 1, f"weight {i}: main_grad untouched"
        assert torch.equal(a, b), f"weight {i}: main_grad differs under hooks"
    for w, g in zip(ws, grads):
        if megatron:  # a placeholder so the parameter's hooks run; the gradient itself is in main_grad
            assert w.grad_added_to_main_grad and g is not None and g.shape == w.shape
        else:
            assert g is None, "the gradient went to .grad instead of main_grad"
