"""The offloaded step's copies, run as an accelerator with asynchronous copies would run them.

On the cpu plugin every copy completes at once, which would hide an ordering bug. Here a
dispatch mode gives ``copy_(..., non_blocking=True)`` device semantics: a copy down into host
memory lands only at the next ``synchronize()`` (until then the host buffer holds NaN, so a
host read that came too early poisons the result), and a copy up reads its host source at that
synchronisation (so a host source overwritten too early is caught there). Host memory is what
the engine's ``HostBuffers`` allocated; everything else plays the device.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.timeout(120)


class AsyncCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.host: set[int] = set()
        self.kept: list[torch.Tensor] = []  # the host buffers (see _async_transfer)
        self.queue: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.issued = 0  # copies queued so far; an event marks a position in this sequence
        self.completed = 0
        self.lock = threading.Lock()
        self.deferred = {"down": 0, "up": 0}
        self.violations: list[str] = []

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if func is torch.ops.aten.copy_.default and non_blocking:
            dst, src = args[0], args[1]
            with self.lock:
                if self.is_host(dst) and not self.is_host(src):
                    self.queue.append(("down", dst, src.detach().clone()))  # the device reads src in stream order
                    self.deferred["down"] += 1
                    self.issued += 1
                    return dst.fill_(float("nan"))
                if self.is_host(src) and not self.is_host(dst):
                    self.queue.append(("up", src, src.detach().clone()))
                    self.deferred["up"] += 1
                    self.issued += 1
        return func(*args, **kwargs)

    def synchronize(self, upto: int | None = None) -> None:
        """Complete the queued copies (those issued before position ``upto``, for an event)."""
        with self.lock:
            n = len(self.queue) if upto is None else max(0, upto - self.completed)
            for kind, tensor, value in self.queue[:n]:
                if kind == "down":
                    tensor.copy_(value)
                elif not torch.equal(tensor, value):
                    self.violations.append("a host source was overwritten before its upload finished")
            del self.queue[:n]
            self.completed += n


class AsyncEvent:
    def __init__(self, mode: AsyncCopies, broken: bool):
        self.mode, self.mark, self.broken = mode, None, broken

    def record(self, stream=None):
        self.mark = self.mode.issued
        if stream is not None:
            stream.recorded += 1

    def synchronize(self):
        if not self.broken:
            self.mode.synchronize(self.mark)

    def query(self):
        return self.mark is not None and self.mode.completed >= self.mark


class FakeStream:
    """A copy stream of the fake device: its copies join the one queue of AsyncCopies (so an event still marks
    a position in it); it counts what was run on it, waited for and recorded."""

    def __init__(self):
        self.entered = self.waits = self.recorded = self.events_waited = 0
        self.waited_on: list[FakeStream] = []

    def wait_stream(self, other):
        self.waits += 1
        self.waited_on.append(other)

    def wait_event(self, event):
        self.waits += 1
        self.events_waited += 1


def _async_transfer(mode: AsyncCopies, broken: bool = False, streams: list | None = None):
    import contextlib

    from polyaccel.engines.zero import offload

    class Syncing:
        def __init__(self, accelerator):
            self._accelerator = accelerator
            self.compute = FakeStream()

        def synchronize(self):
            if not broken:
                mode.synchronize()

        def has(self, capability):
            if capability == "streams":
                return streams is not None
            return capability == "events" or self._accelerator.has(capability)

        def Event(self):
            return AsyncEvent(mode, broken)

        def Stream(self, device=None):
            streams.append(FakeStream())
            return streams[-1]

        def current_stream(self, index=None):
            return self.compute

        @contextlib.contextmanager
        def stream(self, s):
            s.entered += 1
            yield

        def __getattr__(self, name):
            return getattr(self._accelerator, name)

    class AsyncHostTransfer(offload.HostTransfer):
        last = None  # the latest one made

        def __init__(self, host, accelerator, device):
            super().__init__(host, Syncing(accelerator), device)
            self.crosses = True
            AsyncHostTransfer.last = self

        def _crosses(self, a, b):
            return mode.is_host(a) != mode.is_host(b)

    class TrackedHostBuffers(offload.HostBuffers):
        def empty(self, numel, dtype):
            t = super().empty(numel, dtype)
            mode.host.add(t.untyped_storage().data_ptr())
            mode.kept.append(t)  # never freed while the mode lives, so no device tensor can take its address
            return t

    return AsyncHostTransfer, TrackedHostBuffers


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _train(model, zero: dict, steps: int = 4, clip: float = 0.0):
    import polyaccel

    config = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "gradient_clipping": clip, "zero_optimization": {"reduce_bucket_size": 100, **zero}}
    engine = polyaccel.initialize(model, config=config)
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    try:
        for _ in range(steps):
            x = torch.randn(5, 12, generator=g, dtype=torch.float64)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.last_grad_norm)
        return losses, norms, {k: v.clone() for k, v in engine.full_state_dict().items()}
    finally:
        engine.destroy()


ZERO = {
    "stage 1": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "stage 2": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage 3": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 20},
    "stage 3 + params": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                         "stage3_param_persistence_threshold": 20},
}


def _reference(zero):
    import polyaccel

    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(5, 12, generator=g, dtype=torch.float64)
        loss = ref(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert polyaccel  # the engine under test is imported by the caller
    return losses, dict(ref.named_parameters())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_step", "step_after_backward"])
@pytest.mark.parametrize("name", list(ZERO))
def test_offloaded_step_with_asynchronous_copies_matches_adamw(monkeypatch, name, overlap):
    from polyaccel.engines.zero import engine as engine_module
    from polyaccel.engines.zero import host_step

    mode = AsyncCopies()
    transfer, buffers = _async_transfer(mode)
    monkeypatch.setattr(engine_module, "HostTransfer", transfer)
    monkeypatch.setattr(engine_module, "HostBuffers", buffers)
    submitted = []
    original_submit, original_run = host_step.HostStepper.submit, host_step.HostStepper._run

    def run_with_async_copies(self, ranges, event):  # the worker thread's copies are asynchronous too
        with mode:
            original_run(self, ranges, event)

    monkeypatch.setattr(host_step.HostStepper, "submit",
                        lambda self, r: submitted.append(r) or original_submit(self, r))
    monkeypatch.setattr(host_step.HostStepper, "_run", run_with_async_copies)
    zero = {**ZERO[name], "offload_optimizer": {"device": "cpu", "overlap_step": overlap}}
    with mode:
        losses, _, params = _train(_model(), zero)
    ref_losses, ref_params = _reference(ZERO[name])
    assert bool(submitted) == overlap  # stepped during backward (stage 1 too: one micro-step accumulates nothing)
    assert mode.deferred["down"] > 0  # the copies really were asynchronous
    assert mode.deferred["up"] > 0 or "offload_param" in ZERO[name]  # host master -> host shard is no upload
    assert mode.violations == []
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for key, p in ref_params.items():
        torch.testing.assert_close(params[key], p.detach(), rtol=1e-12, atol=1e-12)


def test_a_missing_synchronisation_is_caught(monkeypatch):
    """The same run with synchronize() doing nothing reads host buffers before their copies land."""
    from polyaccel.engines.zero import engine as engine_module

    mode = AsyncCopies()
    transfer, buffers = _async_transfer(mode, broken=True)
    monkeypatch.setattr(engine_module, "HostTransfer", transfer)
    monkeypatch.setattr(engine_module, "HostBuffers", buffers)
    with mode:
        losses, _, params = _train(_model(), ZERO["stage 2"])
    ref_losses, _ = _reference(ZERO["stage 2"])
    assert losses != pytest.approx(ref_losses, rel=1e-12)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_norm_taken_on_the_way_down_equals_the_partition_norm(clip):
    """The squared norm the transfer accumulates is the gradient's: reported norms and clipping agree with
    the same training without offload (which reduces the device partition directly)."""
    base = {"stage": 2}
    _, plain, plain_params = _train(_model(), base, clip=clip)
    _, offloaded, off_params = _train(_model(), {**base, "offload_optimizer": {"device": "cpu"}}, clip=clip)
    assert offloaded == pytest.approx(plain, rel=1e-12)
    assert all(n > 0 for n in plain)
    for key, p in plain_params.items():
        torch.testing.assert_close(off_params[key], p, rtol=1e-12, atol=1e-12)


class SharedTwice(torch.nn.Module):
    """``lin`` is used inside a reentrant checkpoint and again outside it: its gradient hook fires twice."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return self.head(self.lin(torch.tanh(h)))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_gradient_after_its_bucket_was_stepped_is_refused_with_the_fix(overlap):
    import polyaccel
    from polyaccel.engines.zero.host_step import OverlapError

    torch.manual_seed(0)
    model = SharedTwice().double()
    ref = copy.deepcopy(model)
    config = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                                    "offload_optimizer": {"device": "cpu", "overlap_step": overlap}}}
    engine = polyaccel.initialize(model, config=config)
    try:
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        loss = engine(x).square().sum()
        if overlap:
            with pytest.raises(OverlapError, match=r"'lin\.(weight|bias)'.*overlap_step to false"):
                engine.backward(loss)
            return
        engine.backward(loss)
        engine.step()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
        ref(x).square().sum().backward()
        opt.step()
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-12, atol=1e-12)
    finally:
        engine.destroy()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_step", "step_after_backward"])
@pytest.mark.parametrize("name", ["stage 1", "stage 2", "stage 3", "stage 3 + params"])
def test_copy_streams_and_device_side_conversion_equal_the_synchronous_path(monkeypatch, name, overlap):
    """bf16 compute, fp32 master: uploads go up as fp32 in pieces (three elements here) and are converted on the
    device, every copy on a copy stream of its own direction; the result equals the cpu plugin's own run. With
    offload_param the gathers copy the host shards up on a third stream, and the compute stream waits for each
    gather's event before reading it."""
    from polyaccel.engines.zero import engine as engine_module
    from polyaccel.engines.zero import host_step, offload

    zero = {**ZERO[name], "offload_optimizer": {"device": "cpu", "overlap_step": overlap}}

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        import polyaccel

        config = {"bf16": {"enabled": True}, "optimizer": {"type": "adamw", "params": {"lr": 1e-2}},
                  "zero_optimization": {"reduce_bucket_size": 100, **zero}}
        engine = polyaccel.initialize(model, config=config)
        g = torch.Generator().manual_seed(1)
        losses = []
        try:
            for _ in range(3):
                x = torch.randn(5, 12, generator=g).bfloat16()
                loss = engine(x).float().square().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, {k: v.clone() for k, v in engine.full_state_dict().items()}
        finally:
            engine.destroy()

    plain_losses, plain = train()
    mode = AsyncCopies()
    streams: list[FakeStream] = []
    transfer, buffers = _async_transfer(mode, streams=streams)
    monkeypatch.setattr(engine_module, "HostTransfer", transfer)
    monkeypatch.setattr(engine_module, "HostBuffers", buffers)
    monkeypatch.setattr(offload, "UPLOAD_PIECE", 3)
    original_run = host_step.HostStepper._run

    def run_with_async_copies(self, ranges, event):  # the worker thread's copies are asynchronous too
        with mode:
            original_run(self, ranges, event)

    monkeypatch.setattr(host_step.HostStepper, "_run", run_with_async_copies)
    with mode:
        losses, got = train()
    assert mode.deferred["down"] > 0 and mode.deferred["up"] > 0 and mode.violations == []
    used = [streams[0], streams[2]] if "offload_param" in zero else streams  # (host master -> host shard: no upload)
    assert all(s.entered and s.waits and s.recorded for s in used)
    if "offload_param" in zero:  # down, up (made together at the first copy across) and the gathers' stream
        assert len(streams) == 3 and streams[2].entered >= 2 * 2 * 3  # two Linears, forward and backward, 3 steps
        compute = transfer.last.accelerator.compute
        assert compute.events_waited == streams[2].entered  # every gather joined before its module ran
        assert streams[2] in streams[0].waited_on  # copies down (and the host steps after them) wait for gathers
    else:
        assert len(streams) == 2
    assert losses == plain_losses
    for key, p in plain.items():
        assert got[key].dtype == p.dtype and torch.equal(got[key], p), key


def test_an_upload_into_a_non_contiguous_device_tensor_is_converted_whole(monkeypatch):
    from polyaccel.engines.zero import offload

    mode = AsyncCopies()
    transfer_cls, buffers_cls = _async_transfer(mode, streams=[])
    import polyaccel

    acc = polyaccel.get_accelerator()
    host = buffers_cls(acc)
    t = transfer_cls(host, acc, torch.device("cpu"))
    monkeypatch.setattr(offload, "UPLOAD_PIECE", 4)
    master = host.empty(30, torch.float32)
    master.copy_(torch.randn(30))
    dense = torch.zeros(30, dtype=torch.bfloat16)
    strided = torch.zeros(6, 5, dtype=torch.bfloat16).t()  # 5 x 6, not contiguous
    with mode:
        t.start_upload(60, torch.bfloat16)
        t.upload([(dense, master), (strided, master)])
        mode.synchronize()
    assert mode.violations == [] and mode.deferred["up"] == 30 // 4 + 1 + 1
    assert torch.equal(dense, master.bfloat16())
    assert torch.equal(strided, master.bfloat16().view(5, 6))


class CountingSyncs:
    """An accelerator that counts ``synchronize`` calls (and has no events or streams); the rest is the real one."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1

    def has(self, capability):
        return capability not in ("events", "streams") and self._accelerator.has(capability)

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@pytest.mark.parametrize("opt", ["adamw", "muon"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_with_nothing_offloaded_synchronises_nothing(stage, opt):
    """Without offload no copy crosses between host and device memory, so no step may wait for the device:
    a wait at the write-back stopped the host queueing the next step at every step."""
    import polyaccel

    params = {"lr": 1e-2, "weight_decay": 0.01}
    config = {"optimizer": {"type": opt, "params": params},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    engine = polyaccel.initialize(_model(), config=config)
    counting = CountingSyncs(engine.transfer.accelerator)
    engine.transfer.accelerator = counting
    engine.transfer.crosses = True  # as on a GPU, where a copy between host and device memory is asynchronous
    try:
        for step in range(3):
            x = torch.randn(5, 12, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            engine.backward(engine(x).square().mean())
            assert engine.step() is True
    finally:
        engine.destroy()
    assert counting.syncs == 0


def test_a_round_waits_for_the_uploads_that_crossed_before_it(monkeypatch):
    """On a device without events, the next round of uploads waits (one synchronisation) exactly when an upload
    of the last round crossed to the device, so that a host source is never overwritten under its copy."""
    import polyaccel
    from polyaccel.engines.zero import offload

    acc = CountingSyncs(polyaccel.get_accelerator())
    transfer = offload.HostTransfer(offload.HostBuffers(acc, pin=False), acc, torch.device("cpu"))
    transfer.crosses = True
    host, dev = torch.randn(6), torch.empty(6)
    crossing = {"now": False}
    monkeypatch.setattr(transfer, "_crosses", lambda a, b: crossing["now"])
    # (whether this round's upload crosses, synchronisations once its start_upload returned)
    for crossed, syncs in ((True, 0), (False, 1), (True, 1), (True, 2), (False, 3)):
        transfer.start_upload(6, torch.float32)
        assert acc.syncs == syncs
        crossing["now"] = crossed
        host.normal_()
        transfer.upload([(dev, host)])
        assert torch.equal(dev, host)
    transfer.start_upload(6, torch.float32)
    assert acc.syncs == 3


def test_the_host_step_worker_leaves_a_core_to_the_thread_running_backward(monkeypatch):
    """The overlapped host step's CPU kernels run one thread fewer than torch's setting (at least one), or
    ``offload_optimizer.host_threads``; the caller's setting is unchanged."""
    from polyaccel.engines.zero import host_step

    seen = []
    original = host_step.HostStepper._run
    monkeypatch.setattr(host_step.HostStepper, "_run",
                        lambda self, ranges, event: seen.append(torch.get_num_threads()) or original(self, ranges,
                                                                                                   event))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _train(_model(), {"stage": 1, "offload_optimizer": {"device": "cpu"}})
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        _train(_model(), {"stage": 1, "offload_optimizer": {"device": "cpu", "host_threads": 3}})
        assert seen and set(seen) == {3} and torch.get_num_threads() == 2
        assert host_step.worker_threads() == 1 and host_step.worker_threads(5) == 5
        torch.set_num_threads(1)
        assert host_step.worker_threads() == 1  # never zero
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("zero", "match"), [
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "host_threads": 0}}, r"host_threads' must be an integer >= 1"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "host_threads": 2.5}}, "must be an integer >= 1"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "host_threads": True}}, "must be an integer >= 1"),
    ({"stage": 3, "offload_param": {"device": "cpu", "host_threads": 4}}, "offload_param.host_threads' is not "
                                                                          "supported.*under offload_optimizer"),
])
def test_host_threads_refusals_name_the_key(zero, match):
    from polyaccel.engines.zero.config import parse_config
    from polyaccel.errors import ConfigError

    config = {"zero_optimization": zero}
    snapshot = repr(config)
    with pytest.raises(ConfigError, match=match):
        parse_config(config)
    assert repr(config) == snapshot
    assert parse_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}) \
        .offload_optimizer.host_threads is None
