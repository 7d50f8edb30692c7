"""What a routed MoE layer launches besides its experts: the short route for 16-bit softmax routers and the
expert offsets from the sort. Layers with few tokens a step are bound by the host's kernel launches, so the
number of ops is what is checked here (counted at the dispatcher, device-independent), with the numbers
against float64 references."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from polyaccel.engines.autoep import moe
from polyaccel.engines.autoep.presets import Routing
from polyaccel.testing.launches import Launches


def _route_launches(logits: torch.Tensor, routing: Routing) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(ops of route's forward + backward, weights, ids), the backward with a random gradient."""
    leaf = logits.detach().requires_grad_(True)
    grad = torch.randn(logits.shape[0], routing.top_k)
    with Launches() as count:
        weights, idx = moe.route(leaf, routing)
        weights.backward(grad)
    return count.total, weights, idx


def _reference(logits: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' formula in float64: softmax over all experts, the chosen ones renormalised, scaled."""
    probs = torch.softmax(logits.double(), dim=-1).gather(1, idx)
    return probs / probs.sum(dim=-1, keepdim=True) * scale


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_short_route_gives_the_same_experts_and_weights_with_fewer_launches(scale):
    torch.manual_seed(0)
    T, E, k = 96, 16, 4
    logits = torch.randn(T, E).to(torch.bfloat16)
    routing = Routing(top_k=k, scale=scale)
    short, weights, idx = _route_launches(logits, routing)
    assert weights.dtype == torch.float32
    # the experts: the k largest logits (softmax is monotonic), the same set the long formula picks
    long_idx = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)[1]
    assert torch.equal(idx.sort(dim=-1)[0], long_idx.sort(dim=-1)[0])
    torch.testing.assert_close(weights.double(), _reference(logits, idx, scale), rtol=1e-6, atol=1e-7)
    # the gradient with respect to the (bf16) logits, against float64 autograd of the long formula: within the
    # one rounding to bf16
    leaf = logits.detach().requires_grad_(True)
    weights2 = moe.route(leaf, routing)[0]
    grad = torch.randn(T, k)
    (weights2 * grad).sum().backward()
    ref_leaf = logits.double().requires_grad_(True)
    (_reference(ref_leaf, idx, scale) * grad.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=2**-8, atol=1e-6)
    # the long formula (what fp32 logits take) launches 7 or more ops more
    long, long_weights, long_ids = _route_launches(logits.float(), routing)
    assert torch.equal(long_ids, idx)
    torch.testing.assert_close(long_weights, weights, rtol=1e-6, atol=1e-7)
    assert short <= 7 + 2 * (scale != 1.0) and long >= short + 7, (short, long)


@pytest.mark.parametrize("routing", [Routing(top_k=2, route_norm=False), Routing(top_k=2, score_func="sigmoid"),
                                     Routing(top_k=2, num_groups=2, limited_groups=1)])
def test_other_routers_keep_the_long_formula(routing):
    torch.manual_seed(1)
    logits = torch.randn(10, 8).to(torch.bfloat16)
    weights, idx = moe.route(logits, routing)
    wide_weights, wide_idx = moe.route(logits.float(), routing)
    assert torch.equal(idx, wide_idx) and torch.equal(weights, wide_weights)


def test_wide_logits_keep_transformers_order_of_operations():
    """fp32 and fp64 models: the exact sequence of transformers' router (softmax, top k, renormalise)."""
    torch.manual_seed(2)
    logits = torch.randn(12, 8, dtype=torch.float64)
    weights, idx = moe.route(logits, Routing(top_k=2))
    probs = torch.softmax(logits.float(), dim=-1)
    want, want_idx = torch.topk(probs, 2, dim=-1)
    assert torch.equal(idx, want_idx)
    assert torch.equal(weights, want / want.sum(dim=-1, keepdim=True))


def _layer(family: str = "mixtral", **kw) -> moe.AutoEPMoE:
    from autoep_testlib import BLOCK, build
    from polyaccel.engines.autoep import apply_autoep

    model = build(family, **kw)
    apply_autoep(model, {})
    return model.model.layers[BLOCK].mlp


def test_sorted_routes_are_one_sort_one_search_and_the_inverse():
    layer = _layer()
    E = layer.num_experts
    torch.manual_seed(3)
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(37)])  # 37 tokens, top-2, no repeats in a token
    layer._sorted_routes(idx)  # (the expert ids and the row ids are made on first use, then kept)
    with Launches() as count:
        order, inverse, ends = layer._sorted_routes(idx)
    assert count.ops == Counter(sort=1, searchsorted=1, index_put_=1), count.ops
    flat = idx.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(inverse[order], torch.arange(flat.numel()))
    assert torch.equal(ends, torch.cumsum(torch.bincount(flat, minlength=E), 0))
    # another size: row ids made afresh, and right
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(5)])
    with Launches() as count:
        order, inverse, _ = layer._sorted_routes(idx)
    assert count.ops["arange"] == 1 and torch.equal(inverse[order], torch.arange(10))
    # a graphed call keeps nothing between calls (a graph reads what it captured): its row ids are its own
    layer._graphed_call = True
    try:
        with Launches() as count:
            layer._sorted_routes(idx)
    finally:
        layer._graphed_call = False
    assert count.ops["arange"] == 1


def test_the_dispatch_record_derives_counts_only_when_read():
    layer = _layer(top_k=2)
    x = torch.randn(11, layer.router.weight.shape[1], dtype=torch.float64)
    layer(x.view(1, 11, -1))
    record = layer.last_dispatch
    assert "counts" not in record and record["send"] is None and record["recv"] is None
    ids = moe.route(layer.router(x)[0], layer.routing)[1]
    with Launches() as count:
        counts = record["counts"]
    assert count.total == 2, count.ops  # (a pad and a subtraction; read once, then kept)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=layer.num_experts))
    assert record["received"] is counts and record["counts"] is counts
    with pytest.raises(KeyError):
        record["missing"]


def test_a_step_reads_no_offsets_back_to_check_them(monkeypatch):
    """The end rows come from topk ids among the router's E scores, so they are valid by construction and marked
    so: no op of the step reads them back to the host to check them (on a GPU, a wait for the device)."""
    import importlib

    reference_grouped_mm = importlib.import_module("polyaccel.ops.reference.grouped_mm")
    real = reference_grouped_mm._checked_on_host
    reads = []
    monkeypatch.setattr(reference_grouped_mm, "_checked_on_host",
                        lambda off, rows: reads.append(rows) or real(off, rows))
    layer = _layer(top_k=2)
    torch.manual_seed(4)
    x = torch.randn(1, 13, layer.router.weight.shape[1], dtype=torch.float64, requires_grad=True)
    layer(x)[0].sum().backward()
    assert reads == [] and x.grad is not None
    # what the mark claims holds: the end rows pass the host check, every one of the 13 * 2 rows in a group
    ids = torch.stack([torch.randperm(layer.num_experts)[:2] for _ in range(13)])
    ends = layer._sorted_routes(ids)[2]
    assert real(ends, ids.numel()) == ids.numel()
    assert torch.equal(ends, torch.cumsum(torch.bincount(ids.reshape(-1), minlength=layer.num_experts), 0))


def test_a_router_of_the_wrong_width_is_refused_by_name():
    from polyaccel.errors import InvalidArgument

    layer = _layer()
    hidden = layer.router.weight.shape[1]
    layer.router.weight = torch.nn.Parameter(torch.randn(layer.num_experts + 1, hidden, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match=f"router gives {layer.num_experts + 1} scores a token for "
                                              f"{layer.num_experts} experts"):
        layer(torch.randn(1, 3, hidden, dtype=torch.float64))


def test_many_rows_sort_narrow_ids_to_the_same_order():
    """Above torch's in-block sort size the expert ids are sorted as int16 (fewer radix passes on a GPU): the same
    order, inverse and end rows as the int64 sort."""
    layer = _layer()
    E = layer.num_experts
    torch.manual_seed(8)
    T = moe.RADIX_SORT_ROWS // 2 + 3  # top-2: just above the size
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    with Launches() as count:
        order, inverse, ends = layer._sorted_routes(idx)
    assert count.ops["_to_copy"] == 1  # (the cast to int16)
    flat = idx.reshape(-1)
    assert torch.equal(order, torch.sort(flat, stable=True)[1])
    assert torch.equal(inverse[order], torch.arange(flat.numel()))
    assert ends.dtype == torch.int64 and torch.equal(ends, torch.cumsum(torch.bincount(flat, minlength=E), 0))
