"""``offload_optimizer.ratio`` < 1: the last-arriving gradients' share stepped on the device, the rest on the host.

The cpu plugin's host and device are one memory, so the asynchronous-copy stand-in of
``test_zero_offload_ordering`` plays the device here: host memory is what ``HostBuffers``
allocated, and a copy between it and anything else lands late, as on a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_zero_offload_ordering import AsyncCopies, _async_transfer, _model, _reference, _train

pytestmark = pytest.mark.timeout(120)


def test_split_partition_is_sliced_within_one_place_only():
    from polyaccel.engines.zero.split_partition import SplitPartition, ranges, squared_norm

    low, high = torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    part = SplitPartition(low.clone(), high.clone())
    whole = torch.cat([low, high])
    assert part.numel() == 8 and part.cut == 5 and part.shape == torch.Size([8])
    assert torch.equal(part[1:4], whole[1:4]) and part[1:4].data_ptr() == part.low[1:].data_ptr()
    assert torch.equal(part[5:8], whole[5:8]) and part[6:].data_ptr() == part.high[1:].data_ptr()
    with pytest.raises(IndexError, match=r"\[4, 6\) crosses the cut at 5"):
        part[4:6]
    with pytest.raises(TypeError, match="contiguous range"):
        part[::2]
    assert ranges(part, 2, 7) == [(2, 5), (5, 7)] and ranges(part, 5, 8) == [(5, 8)]
    assert ranges(whole, 2, 7) == [(2, 7)]
    torch.testing.assert_close(squared_norm(part), whole.square().sum(), rtol=1e-15, atol=0)
    assert torch.equal(part.cpu(), whole)
    fresh = torch.randn(8, dtype=torch.float64)
    part.copy_(fresh)
    assert torch.equal(part.low, fresh[:5]) and torch.equal(part.high, fresh[5:])
    with pytest.raises(ValueError, match=r"cannot copy \(7,\)"):
        part.copy_(fresh[:7])
    assert not part.zero_().cpu().any()


@pytest.mark.parametrize(("ratio", "cut"), [(0.6, 200), (0.7, 300), (0.625, 300), (0.05, 0), (0.99, 400)])
def test_host_cut_is_the_nearest_bucket_boundary(ratio, cut):
    from polyaccel.engines.zero.split_partition import host_cut

    assert host_cut([0, 100, 200, 300], 400, ratio) == cut


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.ratio")  # (stage 3: whole parameters)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_step", "step_after_backward"])
@pytest.mark.parametrize(("stage", "ratio"), [(1, 0.6), (2, 0.6), (1, 0.3), (2, 0.3), (2, 0.8), (3, 0.5), (3, 0.3)])
def test_partial_offload_with_asynchronous_copies_matches_adamw(monkeypatch, stage, ratio, overlap):
    """fp64 AdamW steps equal torch's with the partition split between the host and the stand-in device; the
    device part never crosses (no copies of its elements), the host part does, and each lives where it should."""
    from polyaccel.engines.zero import engine as engine_module
    from polyaccel.engines.zero import host_step
    from polyaccel.engines.zero.split_partition import SplitPartition

    mode = AsyncCopies()
    transfer, buffers = _async_transfer(mode)
    monkeypatch.setattr(engine_module, "HostTransfer", transfer)
    monkeypatch.setattr(engine_module, "HostBuffers", buffers)
    original_run, places = host_step.HostStepper._run, []

    def run_with_async_copies(self, ranges, event):
        master = self._group.partitioner.master
        places.extend(master.on_device(lo) for lo, _ in ranges)
        with mode:
            original_run(self, ranges, event)

    monkeypatch.setattr(host_step.HostStepper, "_run", run_with_async_copies)
    seen = {}
    original_init = engine_module.ZeroEngine.__init__

    def keep(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["master"] = self.partitioner.master
        seen["state"] = dict(self.optimizer.state)
        seen["grad"] = self.partitioner.grad
        seen["share"] = self.host_optimizer_share

    monkeypatch.setattr(engine_module.ZeroEngine, "__init__", keep)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": ratio, "overlap_step": overlap}}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20
    with mode:
        losses, _, params = _train(_model(), zero)
    ref_losses, ref_params = _reference(zero)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for key, p in ref_params.items():
        torch.testing.assert_close(params[key], p.detach(), rtol=1e-12, atol=1e-12)
    assert mode.violations == [] and mode.deferred["down"] > 0 and mode.deferred["up"] > 0
    for t in (seen["master"], *seen["state"].values(), seen["grad"]):
        assert isinstance(t, SplitPartition) and 0 < t.cut < t.numel() == seen["master"].numel()
        device_part = t.low if t.device_low else t.high
        assert mode.is_host(t.host_part) and not mode.is_host(device_part)
        # the device keeps the parameters whose gradients arrive last: the flat tail (stages 1, 2), the head (3)
        assert t.device_low == (stage == 3)
    assert seen["share"] == seen["master"].host_elements / seen["master"].numel()
    if overlap:  # both places stepped during backward: the device part at once, the host part by the worker
        assert True in places and False in places


def test_partial_offload_copies_only_the_host_part(monkeypatch):
    """Per step, the elements copied down and up are the host part's: the device part stays where it is."""
    from polyaccel.engines.zero import engine as engine_module
    from polyaccel.engines.zero.split_partition import host_cut

    class Counting(AsyncCopies):
        def __init__(self):
            super().__init__()
            self.elements = {"down": 0, "up": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = dict(self.deferred)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for way, n in self.deferred.items():
                if n > before[way]:  # a deferred copy of args[0]'s elements
                    self.elements[way] += args[0].numel()
            return out

    counted = {}
    for ratio in (1.0, 0.5):
        mode = Counting()
        transfer, buffers = _async_transfer(mode)
        monkeypatch.setattr(engine_module, "HostTransfer", transfer)
        monkeypatch.setattr(engine_module, "HostBuffers", buffers)
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": ratio, "overlap_step": False}}
        with mode:
            _train(_model(), zero, steps=2)
        counted[ratio] = mode.elements
    total = sum(p.numel() for p in _model().parameters())
    assert counted[1.0] == {"down": 2 * total, "up": 2 * total}
    cut = host_cut(list(range(0, total, 100)), total, 0.5)  # buckets of 100 elements (_train's)
    assert 0 < cut < total and counted[0.5] == {"down": 2 * cut, "up": 2 * cut}


def test_a_checkpoint_does_not_depend_on_the_ratio(tmp_path):
    """Saved at one ratio, loaded at another (and without offload): the next steps are the same."""
    import polyaccel

    def engine(zero):
        config = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 100, **zero}}
        return polyaccel.initialize(_model(), config=config)

    def steps(e, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            loss = e(torch.randn(5, 12, generator=g, dtype=torch.float64)).square().mean()
            e.backward(loss)
            e.step()
        return {k: v.clone() for k, v in e.full_state_dict().items()}

    first = engine({"offload_optimizer": {"device": "cpu", "ratio": 0.4}})
    steps(first, 2, 1)
    first.save_checkpoint(tmp_path, tag="t")
    expected = steps(first, 2, 2)
    first.destroy()
    for zero in ({"offload_optimizer": {"device": "cpu", "ratio": 0.7}}, {"offload_optimizer": {"device": "cpu"}},
                 {}):
        e = engine(zero)
        e.load_checkpoint(tmp_path, tag="t")
        got = steps(e, 2, 2)
        e.destroy()
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=1e-13, atol=1e-13, msg=lambda m, z=zero: f"{z}: {m}")


@pytest.mark.parametrize(("zero", "optimizer", "match"), [
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}, "adamw",
     r"ratio' must be a number in \(0, 1\]"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "adamw", "must be a number in"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": float("nan")}}, "adamw", "must be a number in"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": True}}, "adamw", "must be a number in"),
    ({"stage": 2, "offload_optimizer": {"device": "none", "ratio": 0.5}}, "adamw", "needs .*device' 'cpu'"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}, "offload_param": {"device": "cpu"}},
     "adamw", "ratio' below 1 is not supported with offload_param"),
    ({"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}, "adamw",
     "offload_param.ratio' is not supported"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "lamb", "needs an element-wise optimizer"),
])
def test_ratio_refusals_name_the_key_and_the_fix(zero, optimizer, match):
    from polyaccel.engines.zero.config import parse_config
    from polyaccel.errors import ConfigError

    config = {"optimizer": {"type": optimizer}, "zero_optimization": zero}
    snapshot = repr(config)
    with pytest.raises(ConfigError, match=match):
        parse_config(config)
    assert repr(config) == snapshot


def test_host_optimizer_share_reports_the_rounded_ratio():
    import polyaccel
    from polyaccel.engines.zero.split_partition import host_cut

    total = sum(p.numel() for p in _model().parameters())
    for zero, share in (({}, 0.0), ({"offload_optimizer": {"device": "cpu"}}, 1.0),
                        ({"offload_optimizer": {"device": "cpu", "ratio": 0.45}},
                         host_cut(list(range(0, total, 100)), total, 0.45) / total)):
        config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 100, **zero}}
        engine = polyaccel.initialize(_model(), config=config)
        try:
            assert engine.host_optimizer_share == share
        finally:
            engine.destroy()
    assert 0 < share < 1


def test_a_ratio_that_whole_buckets_cannot_honour_warns_with_the_fix():
    import polyaccel

    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 10_000,  # one bucket: all or nothing
                                    "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    with pytest.warns(UserWarning, match=r"ratio 0.5 rounds to a host share of 1.00.*1 gradient bucket.*lower "
                                         r"reduce_bucket_size"):
        engine = polyaccel.initialize(_model(), config=config)
    try:
        assert engine.host_optimizer_share == 1.0
    finally:
        engine.destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config["zero_optimization"]["reduce_bucket_size"] = 100
        polyaccel.initialize(_model(), config=config).destroy()
    # stage 3 cuts between parameters: the first layer (208 of 531 elements) is the device's smallest share
    config["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    with pytest.warns(UserWarning, match=r"ratio 0.5 rounds to a host share of 0.61: the split falls between "
                                         r"parameters"):
        engine = polyaccel.initialize(_model(), config=config)
    try:
        assert engine.host_optimizer_share == pytest.approx((531 - 208) / 531)
    finally:
        engine.destroy()
