"""The offloaded Muon step's round copies (engines/zero/muon_transfer.py), as a device with streams would
order them: every copy up waits for the compute stream's work so far (its device memory may have been another
tensor's), the compute stream waits for a round's own copy before reading it, the copy down waits for the
round's Newton-Schulz, and the host reads a buffer only after the event recorded after its copy down.

On the cpu plugin nothing crosses, so a recording accelerator plays the device here: a log of what each
stream was told, in order, and the values that land.
"""

from __future__ import annotations

import contextlib

import torch
from polyaccel.engines.zero.muon_transfer import RoundTransfer


class Log:
    def __init__(self):
        self.lines: list[str] = []


class Stream:
    def __init__(self, log: Log, name: str):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.lines.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event):
        self.log.lines.append(f"{self.name} waits for {event.name}")


class Event:
    count = 0

    def __init__(self, log: Log):
        Event.count += 1
        self.log, self.name, self.synced = log, f"event{Event.count}", False

    def record(self, stream=None):
        self.log.lines.append(f"{self.name} recorded on {'compute' if stream is None else stream.name}")

    def synchronize(self):
        self.log.lines.append(f"host waits for {self.name}")


class Accelerator:
    def __init__(self, capabilities):
        self.log, self.caps = Log(), set(capabilities)
        self.compute = Stream(self.log, "compute")
        self.made = 0
        self.current = self.compute

    def has(self, capability):
        return capability in self.caps

    def current_device(self):
        return 0

    def current_stream(self, index=None):
        return self.current

    def Stream(self, index=None):
        self.made += 1
        return Stream(self.log, ["up", "down"][self.made - 1])

    def Event(self):
        return Event(self.log)

    @contextlib.contextmanager
    def stream(self, s):
        self.log.lines.append(f"enter {s.name}")
        self.current = s
        yield
        self.current = self.compute
        self.log.lines.append(f"leave {s.name}")


class Crossing(RoundTransfer):
    """Host buffers are those the test made; a tensor is 'on the device' otherwise."""

    def __init__(self, accelerator, host):
        super().__init__(accelerator, torch.device("cpu"))
        self.host = host

    def _crosses(self, buf):
        return any(buf is h for h in self.host)


def test_copies_up_and_down_are_ordered_against_the_compute_stream():
    acc = Accelerator({"streams", "events"})
    host = [torch.randn(5), torch.randn(3)]
    want = [h.clone() for h in host]
    rt = Crossing(acc, host)
    ups = rt.up(host)
    assert [torch.equal(d, w) for (d, _), w in zip(ups, want, strict=True)] == [True, True]
    assert all(d.data_ptr() != h.data_ptr() for (d, _), h in zip(ups, host, strict=True))
    events = []
    for (d, ready), h in zip(ups, host, strict=True):
        rt.join(ready)
        acc.log.lines.append(f"newton-schulz of {ready.name}")
        d.mul_(2)
        events.append(rt.down(h, d))
    for e, h, w in zip(events, host, want, strict=True):
        e.synchronize()
        assert torch.equal(h, 2 * w)
    lines = acc.log.lines
    (e1, e2), e3, e4 = [ready.name for _, ready in ups], events[0].name, events[1].name
    assert lines == [
        "up waits for compute", "enter up", f"{e1} recorded on up", f"{e2} recorded on up", "leave up",
        f"compute waits for {e1}", f"newton-schulz of {e1}",
        "down waits for compute", "enter down", "leave down", f"{e3} recorded on down",
        f"compute waits for {e2}", f"newton-schulz of {e2}",
        "down waits for compute", "enter down", "leave down", f"{e4} recorded on down",
        f"host waits for {e3}", f"host waits for {e4}",
    ]


def test_without_streams_the_copies_run_in_order_and_without_events_they_block():
    acc = Accelerator({"events"})
    host = [torch.randn(4)]
    rt = Crossing(acc, host)
    (d, ready), = rt.up(host)
    assert ready is None and torch.equal(d, host[0]) and d.data_ptr() != host[0].data_ptr()
    d.add_(1)
    event = rt.down(host[0], d)
    assert acc.log.lines == [f"{event.name} recorded on compute"]
    assert torch.equal(host[0], d)
    blocking = Crossing(Accelerator(set()), host)
    (d, ready), = blocking.up(host)
    assert ready is None and blocking.down(host[0], d.add_(1)) is None and torch.equal(host[0], d)


def test_on_one_device_nothing_is_copied():
    rt = RoundTransfer(Accelerator({"streams", "events"}), torch.device("cpu"))
    bufs = [torch.randn(3)]
    (d, ready), = rt.up(bufs)
    assert d is bufs[0] and ready is None and rt.down(bufs[0], d) is None
