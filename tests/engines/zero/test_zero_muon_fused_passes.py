"""The Muon device step's element-wise passes through ``ops.muon_momentum`` / ``ops.muon_apply`` (one call per
round each) take the same steps, bit for bit, as the multi-tensor torch ops the step ran before those ops existed
(written out below as they were), on the cpu plugin where the ops' reference serves: fp32 model with the bf16
iteration (bf16 round buffers, the Nesterov update rounded once), the fp32 iteration (fp32 round buffers), plain
momentum, and a bf16 model (bf16 gradients widened), in no more dispatcher calls than before. With the cuda
plugin's Triton builders (under the interpreter) each pass is one kernel launch per round, and the steps stay within
float32 rounding of the previous ones (the interpreter rounds a product and a sum apart where torch's host kernels
fuse them).
"""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config
from torch.utils._python_dispatch import TorchDispatchMode
from zero_testlib import build_model, global_batch, loss_of

pytestmark = pytest.mark.timeout(300)

STEPS = 2


def _span(buf, start, n):
    return buf[start:start + n]


def legacy_fill(self, pieces, grad, send, c):
    """The device path of ``_fill`` before the op: widen, lerp the momentum, form the update, round it."""
    if not pieces:
        return
    mc, dtype = self.mcfg, self.master.dtype
    bufs = [self.state["exp_avg"][lo:hi] for lo, hi, _, _ in pieces]
    dsts = [_span(send, m.owner * c + m.offset + elem, hi - lo) for lo, hi, m, elem in pieces]
    grads = [grad[lo:hi] for lo, hi, _, _ in pieces]
    if grads[0].dtype != dtype:
        sizes = [g.numel() for g in grads]
        out = list(torch.empty(sum(sizes), dtype=dtype, device=grads[0].device).split(sizes))
        torch._foreach_copy_(out, grads)
        grads = out
    torch._foreach_lerp_(bufs, grads, 1 - mc.momentum)
    if not mc.nesterov:
        torch._foreach_copy_(dsts, bufs)
    elif send.dtype == dtype:
        torch._foreach_copy_(dsts, grads)
        torch._foreach_lerp_(dsts, bufs, mc.momentum)
    else:
        torch._foreach_lerp_(grads, bufs, mc.momentum)
        torch._foreach_copy_(dsts, grads)


def legacy_apply(self, pieces, full, c):
    """The device path of ``_apply`` before the op: per (decay, scale) group a multiply and an add."""
    lr = self.lr
    apply = {}
    for lo, hi, m, elem in pieces:
        ps, os_ = apply.setdefault((m.weight_decay, m.lr_scale), ([], []))
        ps.append(self.master[lo:hi])
        os_.append(_span(full, m.owner * c + m.offset + elem, hi - lo))
    for (wd, scale), (ps, os_) in apply.items():
        if lr * wd:
            torch._foreach_mul_(ps, 1 - lr * wd)
        torch._foreach_add_(ps, os_, alpha=-lr * scale)


#: ops that launch no kernel: views and allocations
_NO_KERNEL = {"empty", "empty_like", "split", "split_with_sizes", "slice", "view", "alias", "detach", "as_strided"}


class Calls(TorchDispatchMode):
    """Counts the dispatcher calls that launch a kernel on a device (not views or allocations) inside the block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _train(model_dtype, legacy: bool, triton=None, **params):
    import polyaccel
    from polyaccel.engines.zero.muon import MuonPartitionOptimizer

    config = muon_config(1, **params)
    engine = polyaccel.initialize(build_model("llama", model_dtype, edge=False), config)
    opt = engine.optimizer
    assert isinstance(opt, MuonPartitionOptimizer)
    opt.kept_buffers = False  # the device path (a host partition keeps its buffers by default)
    if triton is not None:
        import polyaccel.engines.zero.muon as zmuon

        zmuon_ops = zmuon.ops
        zmuon.ops = triton
    if legacy:
        opt._fill = legacy_fill.__get__(opt)
        opt._apply = legacy_apply.__get__(opt)
    counts = {"fill": 0, "apply": 0}
    for name in counts:
        real = getattr(opt, f"_{name}")

        def counted(*a, _real=real, _name=name):
            with Calls() as mode:
                _real(*a)
            counts[_name] += mode.n
        setattr(opt, f"_{name}", counted)
    losses = []
    try:
        for step in range(STEPS):
            loss = loss_of(engine, global_batch(step, 1)[:2])
            engine.backward(loss)
            assert engine.step() is True
            losses.append(loss.item())
        state = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        momentum = opt.state["exp_avg"].detach().clone()
        rounds = len(opt.rounds)
    finally:
        engine.destroy()
        if triton is not None:
            zmuon.ops = zmuon_ops
    return losses, state, momentum, counts, rounds


CASES = {
    "fp32 model, bf16 iteration": (torch.float32, {"ns_dtype": "bf16"}),
    "fp32 model, fp32 iteration": (torch.float32, {"ns_dtype": "fp32"}),
    "plain momentum": (torch.float32, {"ns_dtype": "bf16", "nesterov": False, "momentum": 0.3}),
    "bf16 model": (torch.bfloat16, {"ns_dtype": "bf16"}),
}


def test_the_ops_take_the_previous_steps_bit_for_bit_in_no_more_dispatcher_calls(capsys):
    torch.set_num_threads(1)
    report = []
    for name, (dtype, params) in CASES.items():
        new = _train(dtype, False, **params)
        old = _train(dtype, True, **params)
        assert new[0] == old[0], f"{name}: losses differ"
        for key, want in old[1].items():
            assert torch.equal(new[1][key], want), f"{name}: {key} differs from the previous device path"
        assert torch.equal(new[2], old[2]), f"{name}: the momentum differs from the previous device path"
        rounds = new[4]
        assert rounds > 1
        # per round one op call each, whose reference is the previous multi-tensor ops: never more calls
        assert new[3]["fill"] <= old[3]["fill"] and new[3]["apply"] <= old[3]["apply"], (name, new[3], old[3])
        report.append(f"{name}: {rounds} rounds x {STEPS} steps, dispatcher calls fill {old[3]['fill']} -> "
                      f"{new[3]['fill']}, apply {old[3]['apply']} -> {new[3]['apply']}")
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_the_triton_builders_launch_once_a_round_a_pass(count_launches):
    """The engine's step with ``muon_momentum`` / ``muon_apply`` served by the Triton kernels (the registry serves
    them only on cuda: here they are put in the engine's ``ops`` directly, after each call's contract check)."""
    from types import SimpleNamespace

    import polyaccel.ops as ops
    from polyaccel.ops import contract_muon_passes as contract
    from polyaccel.plugins.cuda.kernels import muon_passes as kernels

    torch.set_num_threads(1)
    grids = {name: count_launches(kernels, name) for name in ("_momentum_kernel", "_apply_kernel")}

    def momentum(*a, **kw):
        contract.check_muon_momentum(*a, **kw)
        kernels.muon_momentum(*a, **kw)

    def apply(*a, **kw):
        contract.check_muon_apply(*a, **kw)
        kernels.muon_apply(*a, **kw)

    triton = SimpleNamespace(**{**{k: getattr(ops, k) for k in ops.__all__ if k != "registry"},
                                "muon_momentum": momentum, "muon_apply": apply})
    # the fp32 iteration: with bf16 round buffers the interpreter's conversion to bf16 (it truncates; GPUs round to
    # nearest) moves updates by an ulp, which the bf16 iteration amplifies past any useful bound
    params = {"ns_dtype": "fp32"}
    new = _train(torch.float32, False, triton=triton, **params)
    old = _train(torch.float32, True, **params)
    rounds = new[4]
    launches = {name: len(g) for name, g in grids.items()}
    assert launches == {"_momentum_kernel": rounds * STEPS, "_apply_kernel": rounds * STEPS}, (launches, rounds)
    for key, want in old[1].items():
        torch.testing.assert_close(new[1][key], want, rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(new[2], old[2], rtol=1e-5, atol=1e-6)
