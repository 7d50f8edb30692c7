"""The router's logits computed alone (without transformers' router running its own top-k) where nothing hooks
the router: the same layer output and gradients bit for bit, fewer launches, and the router module called as
before wherever a hook (its own or a global one, transformers' output recorders) is there to see it."""

from __future__ import annotations

import pytest
import torch
from autoep_testlib import BLOCK, build
from polyaccel.engines.autoep import apply_autoep
from polyaccel.engines.autoep.router_logits import is_linear_router
from polyaccel.testing.launches import Launches


def _layer(family: str):
    model = build(family)
    apply_autoep(model, {})
    return model, model.model.layers[BLOCK].mlp


def _step(layer, x, grad):
    """(output, input gradient, every parameter's gradient) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(True)
    out = layer(leaf)
    out = out[0] if isinstance(out, tuple) else out
    (out * grad).sum().backward()
    return out.detach(), leaf.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _counting_forward(router):
    calls = []
    real = router.forward
    router.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    return calls


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_logits_alone_equal_the_router_modules_bit_for_bit(family):
    _, layer = _layer(family)
    assert is_linear_router(layer.router)
    torch.manual_seed(5)
    hidden = layer.router.weight.shape[1]
    x, grad = torch.randn(2, 7, hidden, dtype=torch.float64), torch.randn(2, 7, hidden, dtype=torch.float64)
    _step(layer, x, grad)  # (the layer's expert and row ids are made on first use)
    calls = _counting_forward(layer.router)
    with Launches() as alone:
        got = _step(layer, x, grad)
    assert calls == []  # the router module was not run
    layer._linear_router = False  # what the layer did before: call the router module
    with Launches() as module:
        want = _step(layer, x, grad)
    assert calls == [1]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert "router.weight" in got[2] or "gate.weight" in got[2]
    # the router's own softmax, top-k (and renormalisation, casts) are not run
    saved = module.ops - alone.ops
    assert saved["_softmax"] == 1 and saved["topk"] == 1, (alone.ops, module.ops)
    assert not alone.ops - module.ops and module.total - alone.total >= 4


def test_a_hooked_router_is_called_and_its_hooks_see_the_logits_used():
    _, layer = _layer("mixtral")
    torch.manual_seed(6)
    hidden = layer.router.weight.shape[1]
    x = torch.randn(1, 5, hidden, dtype=torch.float64)
    calls = _counting_forward(layer.router)
    seen = []
    handle = layer.router.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    out = layer(x)
    handle.remove()
    assert calls == [1] and len(seen) == 1
    torch.testing.assert_close(seen[0], x.reshape(-1, hidden) @ layer.router.weight.t(), rtol=0, atol=0)
    # a global forward hook: called too
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        again = layer(x)
    finally:
        handle.remove()
    assert calls == [1, 1] and torch.equal(out, again)
    layer(x)
    assert calls == [1, 1]  # no hooks left: the logits alone


def test_transformers_recorders_still_see_the_router_logits():
    model, block = _layer("mixtral")
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(7))
    plain = model(input_ids=ids).logits
    inputs = []
    block.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    aux = model(input_ids=ids, output_router_logits=True)  # installs transformers' recorder hooks on the routers
    assert len(aux.router_logits) == 2 and torch.equal(aux.logits, plain)
    want = torch.nn.functional.linear(inputs[-1].reshape(-1, inputs[-1].shape[-1]), block.router.weight)
    assert torch.equal(aux.router_logits[BLOCK], want)


def test_which_routers_are_taken_as_linear():
    _, layer = _layer("mixtral")
    router = layer.router
    assert is_linear_router(router) and is_linear_router(torch.nn.Linear(4, 2))

    class MyRouter(type(router)):
        def forward(self, x):
            return super().forward(x * 2)

    assert not is_linear_router(MyRouter.__new__(MyRouter))  # a subclass may compute its logits otherwise
    assert not is_linear_router(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    _, ds = _layer("deepseek_v3")
    assert not is_linear_router(ds.router)  # DeepSeek's router computes its logits in float32 itself
    calls = _counting_forward(ds.router)
    ds(torch.randn(1, 3, ds.router.weight.shape[1], dtype=torch.float64))
    assert calls == [1]


def test_logits_alone_take_a_linears_bias_and_are_what_a_transformers_routers_forward_computes():
    """An ``nn.Linear`` router's bias (or none) is used as its forward uses it; transformers' routers pass no bias to
    ``F.linear``, so an attribute named ``bias`` on one is not added either: the logits are its forward's."""
    from polyaccel.engines.autoep.router_logits import router_logits

    torch.manual_seed(6)
    x = torch.randn(5, 8, dtype=torch.float64)
    for linear in (torch.nn.Linear(8, 3, dtype=torch.float64), torch.nn.Linear(8, 3, bias=False, dtype=torch.float64)):
        assert torch.equal(router_logits(linear, x), linear(x))
    _, layer = _layer("mixtral")
    router = layer.router
    x = torch.randn(5, router.weight.shape[1], dtype=torch.float64)
    router.bias = torch.randn(router.weight.shape[0], dtype=torch.float64)
    calls = _counting_forward(router)
    want = router(x)[0]
    assert calls == [1] and torch.equal(router_logits(router, x), want) and calls == [1]
