"""``capture_graphs: "auto"`` (the default) on the CPU stand-in for device graphs: bucketed token counts
replayed equal to the eager layer, one pool per layer, the layer-wide pending guard, the memory budget,
and every case a graph cannot serve run eagerly with its reason instead of an error."""

from __future__ import annotations

import copy

import pytest
import torch
from autoep_testlib import batch, build, hidden_of, lm_loss
from graph_double import CPUWithGraphs
from polyaccel.engines.autoep import apply_autoep, graphed
from test_autoep_graphs import blocks_of


def test_buckets_are_few_and_bounded():
    assert [graphed.bucket_tokens(t) for t in (1, 16, 17, 20, 21, 24, 25, 4000, 4096, 4097, 5121)] == \
        [16, 16, 20, 20, 24, 24, 28, 4096, 4096, 5120, 6144]
    for t in range(1, 5000):
        b = graphed.bucket_tokens(t)
        assert t <= b <= max(graphed.MIN_BUCKET, t * 1.25)
    per_octave = {graphed.bucket_tokens(t) for t in range(4097, 8193)}
    assert per_octave == {5120, 6144, 7168, 8192}


def _block_pair(family, kw, dtype, section):
    model = build(family, **kw).to(dtype)
    eager = copy.deepcopy(model)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, section)
    return blocks_of(eager)[-1], blocks_of(model)[-1]


def _step(block, x, probe):
    x = x.clone().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    y = hidden_of(block(x))
    (y * probe).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _assert_same_calls(eager, block, sizes, dtype, tol):
    """Fresh random tokens of each length through both blocks: outputs, every gradient and the counts."""
    H = block.spec.hidden_size
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(7 + i)
        x = torch.randn(1, n, H, generator=g, dtype=torch.float64).to(dtype)
        probe = torch.randn(1, n, H, generator=g, dtype=torch.float64).to(dtype)
        want, got = _step(eager, x, probe), _step(block, x, probe)
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
        for name, grad in want[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=tol, atol=tol,
                                       msg=lambda m, k=name, n=n: f"{n} {k}: {m}")
        assert torch.equal(block.last_dispatch["counts"], eager.last_dispatch["counts"]), n
        assert int(block.last_dispatch["counts"].sum()) == n * block.routing.top_k


SIZES = [21, 5, 23, 18, 21, 24]  # buckets 24, 16, 24, 20, 24, 24: a shorter call after a longer one of a bucket


@pytest.mark.parametrize("family,kw,dtype,tol", [
    ("mixtral", {}, torch.float64, 1e-12),
    ("mixtral", {}, torch.float32, 1e-6),
    ("qwen2_moe", {}, torch.float64, 1e-12),  # a shared expert beside the routed ones
    ("deepseek_v3", {"topk_group": 4}, torch.float64, 1e-12),  # sigmoid scores, groups, a correction bias
    ("mixtral", {"experts": 4, "top_k": 4}, torch.float64, 1e-12),  # every token to every expert: the dense path
])
def test_padded_replays_equal_the_eager_layer(graphs, monkeypatch, family, kw, dtype, tol):
    monkeypatch.setattr(graphed, "AUTO_SHAPES_UNMEASURED", 3)
    eager, block = _block_pair(family, kw, dtype, {})
    assert block.capture_graphs == "auto"
    _assert_same_calls(eager, block, SIZES, dtype, tol)
    assert sorted(key[0][0] for key in block._graphs.entries) == [16, 20, 24]
    assert block._graphs.stats == {"captured": 3, "replayed": len(SIZES)}, block._graphs.stats


def test_all_shapes_of_a_layer_share_one_pool(graphs):
    eager, block = _block_pair("mixtral", {}, torch.float64, {"capture_graphs": True})
    _assert_same_calls(eager, block, [16, 24, 20], torch.float64, 1e-12)
    route = block._graphs
    first, *others = route.entries.values()
    assert len(others) == 2 and route.pool is first.fwd.pool()
    assert first.fwd.given_pool is None  # the first capture makes the pool, every later one is given it
    assert all(g.given_pool is route.pool for e in route.entries.values() for g in (e.fwd, e.bwd) if g is not first.fwd)
    assert {id(g.pool()) for e in route.entries.values() for g in (e.fwd, e.bwd)} == {id(route.pool)}


def test_no_forward_of_a_layer_replays_while_any_of_its_backwards_is_due(graphs):
    """Two shapes of one layer, both captured: with the first's backward due, the second runs eagerly (its
    replay could write the first's activations, in the pool they share), and both backwards equal eager."""
    eager, block = _block_pair("mixtral", {}, torch.float64, {})
    _assert_same_calls(eager, block, [16, 24], torch.float64, 1e-12)  # both shapes captured
    H = block.spec.hidden_size
    g = torch.Generator().manual_seed(3)
    xa, xb = (torch.randn(1, n, H, generator=g, dtype=torch.float64) for n in (16, 24))
    grads = []
    for b in (eager, block):
        b.zero_grad()
        a_in, b_in = xa.clone().requires_grad_(True), xb.clone().requires_grad_(True)
        ya, yb = hidden_of(b(a_in)), hidden_of(b(b_in))  # a's backward is due while b runs
        (ya.sum() + (yb * yb).sum()).backward()
        grads.append((a_in.grad, b_in.grad, [p.grad.clone() for p in b.parameters()]))
    (ga, gb, gp), (ha, hb, hp) = grads
    torch.testing.assert_close(ha, ga, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hb, gb, rtol=1e-12, atol=1e-12)
    for got, want in zip(hp, gp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    stats = block._graphs.stats
    assert stats["eager: the previous forward's backward is still due"] == 1 and stats["replayed"] == 3, stats


def _train_equal(eager, model, batches):
    for ids in batches:
        losses = []
        for m in (eager, model):
            m.zero_grad()
            loss = lm_loss(m, ids)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
        want = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _models(section=None):
    model = build("mixtral")
    eager = copy.deepcopy(model)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {} if section is None else section)
    return eager, model


def test_on_an_accelerator_without_graphs_auto_runs_eagerly_and_decides_once(monkeypatch):
    """The cpu accelerator has no device graphs: "auto" trains exactly as eager, looks the accelerator up once
    per layer (not per call) and captures nothing."""
    looked_up = []
    real = graphed.accelerator_for
    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: looked_up.append(dev) or real(dev))
    eager, model = _models()
    _train_equal(eager, model, [batch(s, 0) for s in range(3)])
    blocks = blocks_of(model)
    assert len(looked_up) == len(blocks)
    for b in blocks:
        assert b._graphs.stats == {"eager: no device graphs on cpu": 3} and not b._graphs.entries


def test_what_a_graph_cannot_serve_runs_eagerly_under_auto(graphs, monkeypatch):
    """Under "auto" the refusals of ``true`` become eager calls with the reason: hooked experts (ZeRO stage 3),
    rows above the threshold, a capture that fails (a host read: the cpu plugin's own grouped_mm)."""
    eager, model = _models()
    hooked, big = blocks_of(model)
    hooked.local_experts.register_forward_pre_hook(lambda m, a: None)
    monkeypatch.setattr(graphed, "AUTO_MAX_ROUTED_ROWS", 2 * 16 - 1)  # 16 tokens (a bucket) x top-2: above
    _train_equal(eager, model, [batch(s, 0) for s in range(2)])
    assert hooked._graphs.stats == {"eager: expert modules have forward hooks (ZeRO stage 3 gathers parameters "
                                    "there)": 2}
    assert big._graphs.stats == {"eager: routed rows above AUTO_MAX_ROUTED_ROWS (bound by the device)": 2}
    monkeypatch.setattr(graphed, "AUTO_MAX_ROUTED_ROWS", 2 * 16)
    _train_equal(eager, model, [batch(2, 0)])
    assert big._graphs.stats["captured"] == 1 and big._graphs.stats["replayed"] == 1


def test_a_capture_that_fails_runs_that_shape_eagerly_under_auto(monkeypatch):
    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: CPUWithGraphs())  # the host-reading cpu ops
    eager, model = _models()
    words = r"capturing input \(16, 32\) failed \(HostReadDuringCapture: .*that shape runs eagerly"
    with pytest.warns(RuntimeWarning, match=words):
        _train_equal(eager, model, [batch(s, 0) for s in range(2)])
    for b in blocks_of(model):
        assert b._graphs.stats == {"eager: capture failed": 2} and not b._graphs.entries


def test_ep_above_one_runs_eagerly_under_auto():
    route = graphed.GraphedRoute(lambda x, w, i: None, torch.nn.Linear(2, 2), auto=True, ep_size=2)
    x = torch.randn(4, 2, requires_grad=True)
    assert route(x, torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int64)) is None
    assert route.stats == {"eager: ep > 1 (the all-to-all changes the rows every step)": 1}


class _MeasuredGraphs(CPUWithGraphs):
    """The stand-in with memory statistics: each capture adds ``per_capture`` bytes to the reserved memory."""

    def __init__(self, total: int, per_capture: int) -> None:
        super().__init__()
        self.total, self.per_capture, self.reserved = total, per_capture, 0

    def has(self, capability: str) -> bool:
        return capability in ("graphs", "memory_stats")

    def memory_reserved(self, index=None) -> int:
        return self.reserved

    def total_memory(self, index=None) -> int:
        return self.total

    def capture_to_graph(self, graph, pool=None, stream=None):
        self.reserved += self.per_capture
        return super().capture_to_graph(graph, pool, stream)


def test_captures_stop_at_the_memory_budget(graphs, monkeypatch):
    """Measured: once the graphs of all layers hold AUTO_POOL_BUDGET_FRACTION of the device, no layer captures
    more (the first layer's capture spends it here). Unmeasured: AUTO_SHAPES_UNMEASURED shapes a layer."""
    device = _MeasuredGraphs(total=1000, per_capture=60)  # fwd + bwd: 120 bytes a shape, budget 100
    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: device)
    eager, model = _models()
    _train_equal(eager, model, [batch(0, 0), batch(1, 0)])
    first, second = (b._graphs for b in blocks_of(model))
    assert [e.held for e in first.entries.values()] == [120] and graphed.held_bytes(torch.device("cpu")) == 120
    assert first.stats == {"captured": 1, "replayed": 2}
    assert second.stats == {"eager: graph memory budget spent": 2} and not second.entries

    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: graphs)  # no memory statistics
    eager, model = _models()
    _train_equal(eager, model, [batch(0, 0, size=s) for s in (2, 3, 4, 2)])  # 16, 24 and 32 tokens
    for b in blocks_of(model):
        assert b._graphs.stats == {"captured": 2, "replayed": 3, "eager: graph memory budget spent": 1}


def test_lent_gradients_are_taken_back_before_any_forward_replay_of_the_layer(graphs):
    """Micro-batches of two shapes accumulating: a later capture's static gradient may sit in an earlier graph's
    scratch (one pool), so the ``.grad`` lent by one shape's backward leaves that memory before the other shape's
    forward replays, not only before its own backward; the sums equal eager."""
    eager, model = _models()
    _train_equal(eager, model, [batch(0, 0, size=2), batch(1, 0, size=3)])  # both shapes captured
    block = blocks_of(model)[0]
    first = next(iter(block._graphs.entries.values()))
    for m in (eager, model):
        m.zero_grad()
        lm_loss(m, batch(2, 0, size=2)).backward()
        if m is model:
            lent = [g.untyped_storage().data_ptr() for g in first.grads[2:]]
            assert [p.grad.untyped_storage().data_ptr() for p in block.local_experts.parameters()] == lent
            loss = lm_loss(m, batch(3, 0, size=3))  # the other shape's forward replays
            assert not {p.grad.untyped_storage().data_ptr() for p in block.local_experts.parameters()} & set(lent)
            loss.backward()
        else:
            lm_loss(m, batch(3, 0, size=3)).backward()
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert block._graphs.stats["replayed"] == 4, block._graphs.stats


def test_a_backward_that_cannot_take_its_gradients_back_recomputes_padded_rows_exactly(graphs):
    """A second backward through a retained graph while a caller holds the first one's lent gradients: that
    backward recomputes eagerly from the padded static inputs; gradients and counts still equal eager."""
    eager, block = _block_pair("mixtral", {}, torch.float64, {})
    H = block.spec.hidden_size
    g = torch.Generator().manual_seed(5)
    x, probe = (torch.randn(1, 21, H, generator=g, dtype=torch.float64) for _ in range(2))  # bucket 24
    results = []
    for b in (eager, block):
        xx = x.clone().requires_grad_(True)
        loss = (hidden_of(b(xx)) * probe).sum()
        loss.backward(retain_graph=True)
        kept = [p.grad for p in b.local_experts.parameters()]  # held by the caller
        b.zero_grad()
        xx.grad = None
        loss.backward()
        results.append((xx.grad, [p.grad for p in b.parameters()], b.last_dispatch["counts"], kept))
    (gx, gp, counts, _), (hx, hp, hcounts, _) = results
    torch.testing.assert_close(hx, gx, rtol=1e-12, atol=1e-12)
    for got, want in zip(hp, gp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(hcounts, counts)
    assert block._graphs.stats["backward eagerly: a weight gradient lent out is still held"] == 1


def test_a_dropped_model_frees_its_graphs_without_the_garbage_collector(graphs):
    """No reference cycle through a layer's graphs: their memory goes with the model and leaves the budget."""
    import gc
    import weakref

    _, model = _models()
    lm_loss(model, batch(0, 0)).backward()
    block = blocks_of(model)[0]
    gone = [weakref.ref(x) for x in (block, block._graphs, next(iter(block._graphs.entries.values())))]
    assert graphed.held_bytes(torch.device("cpu")) == 0  # (the stand-in measures nothing)
    del block
    gc.disable()
    try:
        del model
        assert [r() for r in gone] == [None, None, None]
    finally:
        gc.enable()
