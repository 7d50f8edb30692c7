"""AutoEP's routed experts replayed from device graphs (``capture_graphs``), on a CPU stand-in for graphs.

The stand-in (graph_double.py) records the aten ops of capture and replays them on the same
tensors, refusing host reads while capturing, as a device graph does. The cpu plugin's reference
grouped_mm and gather_sum check their index values on the host, so the tests that replay register
builders that read nothing back (as the cuda plugin's do while capturing): the ``graphs`` fixture
(conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from autoep_testlib import batch, build, lm_loss
from graph_double import CPUWithGraphs
from polyaccel.engines.autoep import apply_autoep, graphed, moe, parse_config
from polyaccel.errors import ConfigError, PolyaccelError, Unsupported


def blocks_of(model):
    return [m for m in model.modules() if isinstance(m, moe.AutoEPMoE)]


def assert_same_training(family, steps=3, model_kw=None, check=None):
    """The untouched HF model, AutoEP eager and AutoEP with capture_graphs: AdamW steps on fresh batches give the
    same losses and gradients (the replayed layer against HF itself), and the same expert counts as eager."""
    hf = build(family, **(model_kw or {}))
    eager, graphed_model = copy.deepcopy(hf), copy.deepcopy(hf)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(graphed_model, {"capture_graphs": True})
    models = (hf, eager, graphed_model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in models]
    for step in range(steps):
        ids = batch(step, 0)
        losses = []
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            loss = lm_loss(m, ids)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[2], losses[0], rtol=1e-10, atol=1e-10)
        want = dict(hf.named_parameters())
        for name, p in graphed_model.named_parameters():
            # (DeepSeek-V3 computes its router logits in float32 by design: that gradient to fp32 rounding)
            tol = 1e-6 if family == "deepseek_v3" and name.endswith("mlp.gate.weight") else 1e-10
            torch.testing.assert_close(p.grad, want[name].grad, rtol=tol, atol=tol,
                                       msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        for a, b in zip(blocks_of(graphed_model), blocks_of(eager), strict=True):
            assert torch.equal(a.last_dispatch["counts"], b.last_dispatch["counts"])
        if check is not None:
            check(step, blocks_of(graphed_model))
        for opt in opts:
            opt.step()
    return graphed_model


@pytest.mark.parametrize("family,kw", [("mixtral", {}), ("qwen2_moe", {}), ("deepseek_v3", {"topk_group": 4}),
                                       ("mixtral", {"experts": 4, "top_k": 4})])
def test_replayed_steps_equal_eager_ones(graphs, family, kw):
    """Routing changes every step (new tokens, updated router): the replays must follow it. The last case
    (top-k = experts) captures the dense path."""
    model = assert_same_training(family, model_kw=kw)
    for b in blocks_of(model):
        assert b._graphs.stats == {"captured": 1, "replayed": 3}, b._graphs.stats
    assert graphs.graphs and all(g.replays == 3 for g in graphs.graphs)  # each layer's forward and backward graph


def test_a_second_forward_before_the_backward_runs_eagerly(graphs):
    eager = build("mixtral")
    model = copy.deepcopy(eager)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {"capture_graphs": True})
    lm_loss(model, batch(9, 0)).backward()  # captured and replayed once
    a, b = batch(0, 0), batch(1, 0)
    for m in (eager, model):
        m.zero_grad()
        (lm_loss(m, a) + 2 * lm_loss(m, b)).backward()  # the graph serves a; b, with a's backward due, runs eagerly
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    stats = blocks_of(model)[0]._graphs.stats
    assert stats["replayed"] == 2 and stats["eager: the previous forward's backward is still due"] == 1


def test_no_grad_runs_eagerly_and_moved_parameters_are_captured_again(graphs):
    def check(step, blocks):
        if step == 0:
            with torch.no_grad():  # evaluation: nothing to capture
                blocks[0](torch.randn(1, 5, blocks[0].spec.hidden_size, dtype=torch.float64))
        if step == 1:
            for b in blocks:  # new storage for the experts (what a .to() or a re-materialisation does)
                for p in b.local_experts.parameters():
                    p.data = p.data.clone()

    model = assert_same_training("mixtral", steps=4, check=check)
    stats = blocks_of(model)[0]._graphs.stats
    assert stats["eager: grad mode off"] == 1
    assert stats["recaptured: parameters moved"] == 1 and stats["captured"] == 2


def test_parameters_moved_between_forward_and_backward_are_an_error(graphs):
    model = build("mixtral")
    apply_autoep(model, {"capture_graphs": True})
    lm_loss(model, batch(0, 0)).backward()
    loss = lm_loss(model, batch(1, 0))  # replayed
    for b in blocks_of(model):
        b.local_experts.down_proj.data = b.local_experts.down_proj.data.clone()
    with pytest.raises(PolyaccelError, match=r"moved to new storage between this layer's forward and its backward"):
        loss.backward()


def test_hooked_experts_are_refused_with_the_reason(graphs):
    model = build("mixtral")
    apply_autoep(model, {"capture_graphs": True})
    blocks_of(model)[0].local_experts.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(PolyaccelError, match="forward hooks.*ZeRO stage 3"):
        lm_loss(model, batch(0, 0))


def test_a_host_read_on_the_path_fails_the_capture_clearly(monkeypatch):
    """The cpu plugin's reference grouped_mm checks the offsets on the host: capture must refuse, not freeze them."""
    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: CPUWithGraphs())
    model = build("mixtral")
    apply_autoep(model, {"capture_graphs": True})
    with pytest.raises(PolyaccelError, match="without reading values back to the host") as info:
        lm_loss(model, batch(0, 0))
    assert "reads a device value back" in str(info.value.__cause__)


def test_a_backend_without_graphs_raises_unsupported():
    model = build("mixtral")
    apply_autoep(model, {"capture_graphs": True})
    with pytest.raises(Unsupported, match="graphs") as info:
        lm_loss(model, batch(0, 0))
    assert "capture_graphs to false" in str(info.value)
    with torch.no_grad():  # evaluation never captures
        model(input_ids=batch(0, 0))


@pytest.mark.parametrize("section,words", [
    ({"capture_graphs": True, "autoep_size": 2}, "needs 'expert_parallel.autoep_size' 1"),
    ({"capture_graphs": "yes"}, r"'expert_parallel.capture_graphs' must be one of true, false, auto, got 'yes'"),
    ({"capture_graphs": 1}, r"'expert_parallel.capture_graphs' must be one of true, false, auto, got 1"),
    ({"capture_graphs": None}, r"'expert_parallel.capture_graphs' must be one of true, false, auto, got null"),
])
def test_capture_graphs_config_is_checked(section, words):
    given = copy.deepcopy(section)
    with pytest.raises(ConfigError, match=words):
        parse_config(section)
    assert section == given
    assert parse_config({"capture_graphs": True}).capture_graphs is True
    assert parse_config({}).capture_graphs == "auto"
    assert parse_config({"capture_graphs": "Auto"}).capture_graphs == "auto"
    assert parse_config({"capture_graphs": "auto", "autoep_size": 2}).capture_graphs == "auto"  # (eager at ep > 1)


def _zero_config(stage: int, graphs: bool) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 5000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter gathered by hooks, none kept whole
    return {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero,
            "gradient_clipping": 1.0, "expert_parallel": {"capture_graphs": graphs}}


def test_zero_stage2_with_replayed_experts_trains_like_eager(graphs):
    """The replayed layer's gradients reach ZeRO's gradient hooks and buckets as the eager layer's do."""
    import polyaccel

    engines = [polyaccel.initialize(build("mixtral"), _zero_config(2, g)) for g in (False, True)]
    try:
        for step in range(3):
            losses = []
            for engine in engines:
                loss = lm_loss(engine, batch(step, 0))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            assert abs(losses[1] - losses[0]) <= 1e-10, (step, losses)
        want = engines[0].full_state_dict()
        for name, value in engines[1].full_state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
        assert blocks_of(engines[1].module)[0]._graphs.stats == {"captured": 1, "replayed": 3}
    finally:
        for engine in engines:
            engine.destroy()


def test_zero_stage3_with_replayed_experts_is_refused(graphs):
    import polyaccel

    engine = polyaccel.initialize(build("mixtral"), _zero_config(3, True))
    try:
        with pytest.raises(PolyaccelError, match="ZeRO stage 3"):
            lm_loss(engine, batch(0, 0))
    finally:
        engine.destroy()


def test_frozen_experts_replay_and_still_count_as_moved(graphs):
    """Expert weights that take no gradient are still read by the graphs: replays follow their values, and
    new storage for them is noticed like for trained ones."""
    eager = build("mixtral")
    model = copy.deepcopy(eager)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {"capture_graphs": True})
    for m in (eager, model):
        for b in blocks_of(m):
            b.local_experts.down_proj.requires_grad_(False)
    for step in range(3):
        for m in (eager, model):
            m.zero_grad()
            with torch.no_grad():
                for b in blocks_of(m):
                    b.local_experts.down_proj.mul_(1.1)  # frozen, but changed in place between steps
            lm_loss(m, batch(step, 0)).backward()
        want = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-10,
                                           msg=lambda m, n=name: f"{n}: {m}")
    b = blocks_of(model)[0]
    b.local_experts.down_proj.data = b.local_experts.down_proj.data.clone()
    lm_loss(model, batch(5, 0)).backward()
    assert b._graphs.stats["recaptured: parameters moved"] == 1


def test_a_deep_copy_of_a_replaying_model_captures_afresh(graphs):
    model = build("mixtral")
    apply_autoep(model, {"capture_graphs": True})
    lm_loss(model, batch(0, 0)).backward()
    twin = copy.deepcopy(model)
    assert all(not b._graphs.entries for b in blocks_of(twin))
    lm_loss(twin, batch(1, 0)).backward()
    lm_loss(model, batch(1, 0)).backward()
    for a, b in zip(blocks_of(twin), blocks_of(model), strict=True):
        assert a._graphs.entries and a._graphs.experts is a.local_experts and a._graphs.stats["captured"] == 1
        assert b._graphs.stats["captured"] == 1 and b._graphs.stats["replayed"] == 2


def _expert_grads(model):
    return [p.grad for b in blocks_of(model) for p in b.local_experts.parameters()]


def test_weight_gradients_are_lent_not_copied_and_accumulate_over_micro_batches(graphs):
    """The replayed backward hands its weight gradients over as .grad (no copy); a second backward before the
    optimizer (accumulation) moves the first .grad off the graph's memory, then adds: the same sums as eager."""
    eager = build("mixtral")
    model = copy.deepcopy(eager)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {"capture_graphs": True})
    lm_loss(model, batch(9, 0)).backward()  # captured
    for m in (eager, model):
        m.zero_grad()
        for micro in range(3):
            lm_loss(m, batch(micro, 0)).backward()
            if m is model and micro == 0:
                statics = [g for b in blocks_of(model) for g in next(iter(b._graphs.entries.values())).grads[2:]]
                lent = [g.untyped_storage().data_ptr() for g in _expert_grads(model)]
                assert lent == [g.untyped_storage().data_ptr() for g in statics]
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    assert "backward eagerly: a weight gradient lent out is still held" not in blocks_of(model)[0]._graphs.stats


def test_a_lent_gradient_held_elsewhere_is_never_overwritten(graphs):
    eager = build("mixtral")
    model = copy.deepcopy(eager)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {"capture_graphs": True})
    lm_loss(model, batch(9, 0)).backward()
    model.zero_grad()
    lm_loss(model, batch(0, 0)).backward()
    kept = _expert_grads(model)  # a caller keeps the gradients of this step
    snapshot = [g.clone() for g in kept]
    model.zero_grad()
    lm_loss(model, batch(1, 0)).backward()  # must not write into the kept tensors: that forward runs eagerly
    for got, was in zip(kept, snapshot, strict=True):
        assert torch.equal(got, was)
    eager.zero_grad()
    lm_loss(eager, batch(1, 0)).backward()
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    assert blocks_of(model)[0]._graphs.stats["eager: a weight gradient lent out is still held"] == 1


def _steps_equal(eager, model, batches):
    for ids in batches:
        for m in (eager, model):
            m.zero_grad()
            lm_loss(m, ids).backward()
        want = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-10,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _pair(family="mixtral"):
    eager = build(family)
    model = copy.deepcopy(eager)
    apply_autoep(eager, {"capture_graphs": False})
    apply_autoep(model, {"capture_graphs": True})
    return eager, model


def test_shapes_beyond_the_cap_run_eagerly_with_one_warning(graphs, monkeypatch):
    monkeypatch.setattr(graphed, "MAX_SHAPES", 1)
    eager, model = _pair()
    with pytest.warns(RuntimeWarning, match="more than 1 input shapes") as seen:
        _steps_equal(eager, model, [batch(0, 0), batch(1, 0, size=3), batch(2, 0, size=3), batch(3, 0)])
    stats = blocks_of(model)[0]._graphs.stats
    assert stats == {"captured": 1, "replayed": 2, "eager: shapes beyond MAX_SHAPES": 2}, stats
    assert len([w for w in seen if "input shapes" in str(w.message)]) == len(blocks_of(model))  # once per layer


def test_a_capture_that_runs_out_of_memory_leaves_that_shape_eager(graphs, monkeypatch):
    def no_memory(graph, pool=None, stream=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graphs, "capture_to_graph", no_memory)
    eager, model = _pair()
    with pytest.warns(RuntimeWarning, match="ran out of device memory .*Tried to allocate 2.00 GiB"):
        _steps_equal(eager, model, [batch(0, 0), batch(1, 0)])
    stats = blocks_of(model)[0]._graphs.stats
    assert stats == {"eager: capture ran out of device memory": 2} and not blocks_of(model)[0]._graphs.entries


@pytest.mark.parametrize("family,reentrant,early_stop", [("mixtral", False, True), ("qwen2_moe", False, False),
                                                          ("mixtral", True, True)])
def test_activation_checkpointing_recomputes_eagerly_and_trains_like_eager(graphs, family, reentrant, early_stop):
    """HF activation checkpointing calls the layer again in backward: with the replayed forward's backward still
    due (non-reentrant; without early stop the recompute runs through the layer and must save what the replay
    saved: Qwen's shared expert saves its own after it), or first under no_grad then with grad (reentrant),
    every step still equals eager."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    eager, model = _pair(family)
    for m in (eager, model):
        m.train()
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with set_checkpoint_early_stop(early_stop):
        _steps_equal(eager, model, [batch(s, 0) for s in range(3)])
    stats = blocks_of(model)[0]._graphs.stats
    assert stats.get("replayed", 0) >= 2, stats
