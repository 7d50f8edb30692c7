"""What the engine keeps per parameter at world size 1, and that keeping less changes no number.

bf16 with AdamW, one micro-step, optimizer on the device: between steps 2 bytes of 16-bit
parameter, 4 of fp32 master and 8 of moments = 14 bytes per parameter, nothing more (12 at
stage 3, whose gathers cast the master: no 16-bit shard is kept). The gradient partition exists
from the first reduced bucket to the step and holds the compute dtype (reduced 16-bit buckets,
never accumulated: an fp32 copy would add bytes and no precision), on the host too when the
optimizer is offloaded. Accumulation, loss scaling, or clipping of an offloaded step keep an fp32
gradient partition.
"""

from __future__ import annotations

import copy
import gc
import weakref

import polyaccel
import pytest
import torch
from zero_testlib import build_model, lm_loss

pytestmark = pytest.mark.timeout(120)


def _config(stage, **extra):
    zero = {"stage": stage, "reduce_bucket_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    zero.update(extra.pop("zero", {}))
    cfg = {"bf16": {"enabled": True}, "zero_optimization": zero,
           "optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": 1.0}}}
    cfg.update(extra)
    return cfg


def _ids(step):
    return torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(step))


def _live_bytes():
    """Bytes of every storage a live tensor references."""
    gc.collect()
    sizes = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            try:
                st = obj.untyped_storage()
                sizes[st.data_ptr()] = st.nbytes()
            except RuntimeError:  # a fake tensor (a torch.compile cache from an earlier test): holds no memory
                continue
    return sum(sizes.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_adamw_keeps_fourteen_bytes_per_parameter_between_steps_twelve_at_stage_3(stage):
    before = _live_bytes()
    model = build_model("llama", torch.float32, edge=False)
    n = sum(p.numel() for p in model.parameters())
    engine = polyaccel.initialize(model, _config(stage))
    for step in range(2):
        engine.backward(lm_loss(engine, _ids(step)))
        engine.step()
    held = _live_bytes() - before
    try:
        # stage 1/2 pad the flat buffers to whole buckets; stage 3 keeps no 16-bit shard beside the master
        # (a gather casts it) and gathers nothing between steps here (no persistent parameters)
        per_param = 12 if stage == 3 else 14
        assert per_param - 0.1 <= held / n <= per_param + 14 * 3000 / n, (held / n, "bytes per parameter")
        assert engine.partitioner.grad.dtype == torch.bfloat16
    finally:
        engine.destroy()


@pytest.mark.parametrize("extra", [{"gradient_accumulation_steps": 2},
                                   {"bf16": {"enabled": False}, "fp16": {"enabled": True}},
                                   {"zero": {"offload_optimizer": {"device": "cpu"}}, "gradient_clipping": 1.0}],
                         ids=["accumulation", "fp16", "offload-clipped"])
def test_fp32_gradient_partition_where_it_accumulates_or_an_offloaded_step_scales_it(extra):
    engine = polyaccel.initialize(build_model("llama", torch.float32, edge=False), _config(2, **copy.deepcopy(extra)))
    assert engine.partitioner.grad.dtype == torch.float32
    engine.destroy()


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True), (3, False), (3, True)])
def test_offloaded_sixteen_bit_gradient_partition_steps_exactly_like_the_device_one(stage, overlap):
    """The offloaded optimizer keeps the 16-bit gradient on the host (2 bytes a parameter, not 4) and its step
    (after backward, or bucket by bucket during it) gives bit for bit the weights of the step on the device."""
    runs = []
    for offload in (False, True):
        zero = {"offload_optimizer": {"device": "cpu", "overlap_step": overlap}} if offload else {}
        engine = polyaccel.initialize(build_model("llama", torch.float32, seed=5, edge=False),
                                      _config(stage, zero=zero))
        try:
            for step in range(3):
                engine.backward(lm_loss(engine, _ids(200 + step)))
                engine.step()
            assert engine.partitioner.grad.dtype == torch.bfloat16
            runs.append(engine.partitioner.master.detach().clone())  # (stage 3 releases the parameters)
        finally:
            engine.destroy()
    assert runs[0].numel() > 3000 and torch.equal(*runs)


@pytest.mark.parametrize("stage", [2, 3])
def test_sixteen_bit_gradient_partition_steps_like_the_fp32_update(stage):
    """Clipped AdamW with a large eps (so the clipping factor changes the update) against a reference that
    takes the 16-bit gradients to fp32, clips with the fp64 norm and steps ``torch.optim.AdamW`` on an fp32
    master copy."""
    model = build_model("llama", torch.float32, seed=3, edge=False)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.01, eps=1.0)
    engine = polyaccel.initialize(model, _config(stage, gradient_clipping=0.05))
    for step in range(3):
        ids = _ids(100 + step)
        engine.backward(lm_loss(engine, ids))
        engine.step()
        lm_loss(ref, ids).backward()
        grads = [p.grad.float() for p in ref.parameters()]
        norm = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])).item()
        coef = min(1.0, 0.05 / (norm + 1e-6))
        assert coef < 0.5  # the clip is active
        for m, g in zip(master, grads, strict=True):
            m.grad = g * coef
        opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master, strict=True):
                p.copy_(m)
                p.grad = None
        assert engine.last_grad_norm == pytest.approx(norm, rel=1e-6)
    got = engine.full_state_dict()
    for (name, p) in ref.named_parameters():
        torch.testing.assert_close(got[name].float(), p.float(), rtol=0, atol=2 ** -7 * p.abs().max().item(),
                                   msg=name)
    engine.destroy()


def test_stage3_releases_module_outputs_without_a_garbage_collection():
    """The wrapped outputs (the logits among them) go when the caller drops them, not at the next collection."""
    engine = polyaccel.initialize(build_model("llama", torch.float32, edge=False), _config(3))
    gc.disable()
    try:
        logits = engine(input_ids=_ids(0)).logits
        alive = weakref.ref(logits)
        loss = logits.float().sum()
        del logits
        engine.backward(loss)
        engine.step()
        assert alive() is None
    finally:
        gc.enable()
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_destroy_gives_the_training_state_back_at_once(stage):
    """Master copy, moments and gradients go at ``destroy()``, while the caller still holds the engine."""
    engine = polyaccel.initialize(build_model("llama", torch.float32, edge=False), _config(stage))
    engine.backward(lm_loss(engine, _ids(0)))
    engine.step()
    engine.backward(lm_loss(engine, _ids(1)))  # a gradient partition exists now
    kept = [weakref.ref(t) for t in (engine.partitioner.master, engine.partitioner.grad,
                                     *engine.optimizer.state.values())]
    weights = engine.full_state_dict()
    gc.disable()
    try:
        engine.destroy()
        assert all(ref() is None for ref in kept)
    finally:
        gc.enable()
    after = engine.full_state_dict()  # the parameters themselves survive, in the compute dtype
    assert set(after) == set(weights) and all(torch.equal(after[k], weights[k]) for k in weights)


def test_stage3_at_world_size_one_settles_each_gradient_without_waiting_for_a_bucket():
    """Nothing to exchange at world size 1: a gradient goes to the partition when it arrives (at most the
    order's small gaps wait), however large ``reduce_bucket_size`` is, so backward never holds a bucket."""
    model = build_model("llama", torch.float32, edge=False)
    sizes = sorted((p.numel() for p in model.parameters()), reverse=True)
    engine = polyaccel.initialize(model, _config(3, zero={"reduce_bucket_size": 10**9}))
    reducer, pending = engine.partitioner.reducer, []
    reduce = reducer._reduce_bucket

    def counting(k):
        pending.append(sum(g.numel() for g in reducer._grads.values()))
        reduce(k)

    reducer._reduce_bucket = counting
    try:
        engine.backward(lm_loss(engine, _ids(0)))
        engine.step()
        assert len(pending) == len(sizes)  # one settle per parameter
        assert max(pending) <= 2 * sizes[0] < sum(sizes) / 2, (max(pending), sizes[:2])
    finally:
        engine.destroy()


def _first_node_saving(fn, attr):
    seen, todo = set(), [fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if attr in dir(fn):  # (hasattr would read, and so unpack, the saved tensor)
            return fn
        todo.extend(f for f, _ in fn.next_functions)
    raise AssertionError(f"no autograd node with {attr}")


def test_stage3_frees_each_gathered_parameter_after_its_forward_though_autograd_saved_views_of_it():
    """``linear`` saves ``weight.t()``, a view that would keep the gathered storage alive until backward (every
    layer's weights at once at the end of forward). Stage 3 saves a reference instead: each gathered storage is
    gone once its module's forward returns; backward gathers again (the parity tests check its numbers)."""
    engine = polyaccel.initialize(build_model("llama", torch.float32, edge=False), _config(3))
    engine.backward(lm_loss(engine, _ids(0)))  # a first step records the module order
    engine.step()
    refs = []

    def remember(module, args):
        refs.extend(p.untyped_storage()._weak_ref() for p in module.parameters(recurse=False) if p.numel())

    hooks = [m.register_forward_pre_hook(remember) for m in engine.module.modules() if isinstance(m, torch.nn.Linear)]
    try:
        loss = lm_loss(engine, _ids(1))
        for h in hooks:
            h.remove()
        assert len(refs) >= 8
        alive = [r for r in refs if not torch.UntypedStorage._expired(r)]
        assert not alive, f"{len(alive)} of {len(refs)} gathered weights still allocated after forward"
        node = _first_node_saving(loss.grad_fn, "_saved_mat2")  # a linear's saved weight view
        with pytest.raises(RuntimeError, match="which is not gathered now"):
            node._saved_mat2  # noqa: B018 - reading it unpacks it, outside the module's backward
        engine.backward(loss)
        engine.step()
    finally:
        for r in refs:
            torch.UntypedStorage._free_weak_ref(r)
        engine.destroy()


@pytest.mark.parametrize("kw", [{}, {"granularity": 3000, "offload": True, "offload_param": True}],
                         ids=["plain", "whole-layers-offload-param"])
def test_stage3_at_world_size_one_matches_plain_training_with_saved_parameter_references(kw):
    """World size 1 in float64, against plain training: in-place gathers (views of the master here) and whole decoder
    layers uploaded from the host, each saved parameter view resolved again in backward."""
    from zero_testlib import reference_run, train_engine, zero_config

    steps = 4
    ref_losses, ref_params, _ = reference_run("llama", torch.float64, steps, 1)
    engine = polyaccel.initialize(build_model("llama", torch.float64), zero_config(3, **kw))
    try:
        losses = train_engine(engine, steps, 0)
        params = engine.full_state_dict()
    finally:
        engine.destroy()
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-12)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name].double(), want, rtol=1e-10, atol=1e-10, msg=name)


def test_stage3_saved_tensor_hook_passes_sparse_tensors_through():
    """A sparse tensor autograd saves (``torch.sparse.mm`` keeps its sparse operand) has no single storage to
    compare with a parameter's: the pack hook leaves it alone, and gradients match plain autograd."""

    class SparseMix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8))
            idx = torch.tensor([[0, 1, 2, 3, 5], [1, 0, 3, 2, 4]])
            self.register_buffer("mix", torch.sparse_coo_tensor(idx, torch.randn(5), (6, 6)).coalesce())

        def forward(self, x):  # the sparse operand is saved while this module's weight is gathered
            return torch.sparse.mm(self.mix, x @ self.weight).square().sum()

    torch.manual_seed(3)
    model = SparseMix()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8)
    plain(x).backward()
    engine = polyaccel.initialize(model, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                          "optimizer": {"type": "adamw", "params": {"lr": 0.0}}})
    try:
        engine.backward(engine(x))
        layout, grad = engine.partitioner.layout, engine.partitioner.grad
        got = {name: grad[off:off + n] for name, off, n in zip(layout.names, layout.part_offsets, layout.numels,
                                                               strict=True)}
    finally:
        engine.destroy()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad.reshape(-1), rtol=1e-5, atol=1e-6, msg=name)


def test_stage3_at_world_size_one_keeps_buckets_when_the_optimizer_is_offloaded():
    """With the optimizer offloaded a bucket is the unit of the copy down and of the host step, so world size 1
    keeps ``reduce_bucket_size`` buckets there (one per parameter would pay those fixed costs per parameter);
    the gradients and the step still equal the per-parameter run's."""
    results = {}
    for offload in (False, True):
        zero = {"reduce_bucket_size": 10**9}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        torch.manual_seed(0)
        engine = polyaccel.initialize(build_model("llama", torch.float64, edge=False), _config(3, zero=zero))
        try:
            n_params = sum(1 for p in engine.module.parameters() if p.requires_grad)
            assert len(engine.partitioner.reducer._buckets) == (1 if offload else n_params)
            engine.backward(lm_loss(engine, _ids(0)))
            engine.step()
            results[offload] = {k: v.clone() for k, v in engine.full_state_dict().items()}
        finally:
            engine.destroy()
    assert results[True].keys() == results[False].keys()
    for k in results[False]:
        torch.testing.assert_close(results[True][k], results[False][k], rtol=1e-10, atol=1e-12)


def test_stage3_hooks_only_modules_with_something_to_gather():
    """A module whose parameters are all persistent (always gathered: norms, small biases) gets no stage-3 hooks,
    so its forward and backward pay no gather bookkeeping; a module with a partitioned weight does."""
    model = build_model("llama", torch.float32, edge=False)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    threshold = max(m.weight.numel() for m in norms)
    assert norms and linears and min(m.weight.numel() for m in linears) > threshold
    engine = polyaccel.initialize(model, _config(3, zero={"stage3_param_persistence_threshold": threshold}))
    try:
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in norms)
        assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 for m in linears)
        engine.backward(lm_loss(engine, _ids(0)))
        assert engine.step()
    finally:
        engine.destroy()
