"""Device basics every accelerator must have: identity, probe, devices, synchronize, copies."""

from __future__ import annotations

import pytest
import torch
from polyaccel.version import API_VERSION, api_major


@pytest.mark.conformance(area="device", subject="identity", check="identity")
def test_identity(conformance_target):
    acc = conformance_target.accelerator
    assert isinstance(acc.name, str) and acc.name, "accelerator.name must be a non-empty string"
    if not conformance_target.emulated:  # an emulated runtime keeps tensors on the host
        torch.device(acc.device_type)  # raises for a device type torch does not know
    assert api_major(acc.api_version) == api_major(API_VERSION), (
        f"api_version {acc.api_version} has another major than polyaccel's {API_VERSION}")
    assert isinstance(acc.priority, int), f"priority must be an int, got {acc.priority!r}"
    assert isinstance(acc.communication_backend, str) and acc.communication_backend, (
        "communication_backend must name a torch.distributed backend")
    caps = acc.capabilities()
    assert all(isinstance(c, str) for c in caps), f"capabilities() must be strings, got {sorted(map(repr, caps))}"
    assert frozenset(caps) == frozenset(acc.capabilities()), "capabilities() changed between two calls"


@pytest.mark.conformance(area="device", subject="probe", check="probe")
def test_probe(conformance_target):
    from polyaccel.accelerator import ProbeResult

    acc = conformance_target.accelerator
    probe = acc.probe()
    assert isinstance(probe, ProbeResult), f"probe() returned {type(probe).__name__}, not ProbeResult"
    assert probe.available, f"probe() says unavailable ({probe.reason}) although the accelerator was selected"
    assert probe.device_count >= 1, f"probe() reports {probe.device_count} devices"
    assert bool(probe.emulated) == bool(acc.is_emulated()), (
        f"probe().emulated={probe.emulated} but is_emulated()={acc.is_emulated()}")


@pytest.mark.conformance(area="device", subject="devices", check="count_current_set")
def test_devices(conformance_target):
    acc = conformance_target.accelerator
    count = acc.device_count()
    assert isinstance(count, int) and count >= 1, f"device_count() returned {count!r}"
    start = acc.current_device()
    assert 0 <= start < count, f"current_device() {start} is outside [0, {count})"
    # emulated runtimes keep tensors on the host (polyaccel.testing.emulation.emulate_accelerator)
    device_type = "cpu" if conformance_target.emulated else acc.device_type
    dev = acc.device()
    assert isinstance(dev, torch.device) and dev.type == device_type, (
        f"device() returned {dev!r}, expected a torch.device of type {device_type!r}")
    try:
        for i in range(min(count, 4)):
            acc.set_device(i)
            assert acc.current_device() == i, f"set_device({i}) left current_device() at {acc.current_device()}"
            assert acc.device(i).type == device_type, f"device({i}) is {acc.device(i)!r}"
    finally:
        acc.set_device(start)
    assert acc.current_device() == start


@pytest.mark.conformance(area="device", subject="synchronize", check="compute_and_synchronize")
def test_synchronize(conformance_target):
    acc = conformance_target.accelerator
    x = torch.randn(257, 33, dtype=torch.float32)
    d = x.to(acc.device())
    y = (d * 3.0 - 1.0).sum(dim=1)
    acc.synchronize()
    expected = (x.double() * 3.0 - 1.0).sum(dim=1)
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.conformance(area="device", subject="copies", check="host_device_roundtrip_bit_exact")
def test_host_device_roundtrip(conformance_target):
    acc = conformance_target.accelerator
    for dtype in acc.supported_dtypes():
        x = torch.randn(1001, dtype=torch.float32).to(dtype)
        back = x.to(acc.device()).to("cpu")
        acc.synchronize()
        assert torch.equal(back, x), f"{dtype}: host -> device -> host copy changed the data"


@pytest.mark.conformance(area="device", subject="execution_model", check="flags")
def test_execution_model_flags(conformance_target):
    acc = conformance_target.accelerator
    for flag in ("is_synchronized_device", "use_host_timers", "resolves_data_dependency",
                 "handles_memory_backpressure"):
        value = getattr(acc, flag)()
        assert isinstance(value, bool), f"{flag}() must return a bool, got {value!r}"


@pytest.mark.conformance(area="device", subject="dtypes", check="supported_dtypes_match_claims")
def test_supported_dtypes(conformance_target):
    acc = conformance_target.accelerator
    dtypes = acc.supported_dtypes()
    assert torch.float32 in dtypes, f"supported_dtypes() {dtypes} lacks torch.float32"
    for cap, dtype, query in (("bf16", torch.bfloat16, "is_bf16_supported"),
                              ("fp16", torch.float16, "is_fp16_supported"),
                              ("fp64", torch.float64, "is_fp64_supported")):
        claimed = acc.has(cap)
        assert (dtype in dtypes) == claimed, (
            f"supported_dtypes() {'lists' if dtype in dtypes else 'omits'} {dtype} but {cap!r} is "
            f"{'claimed' if claimed else 'not claimed'}")
        assert getattr(acc, query)() == claimed, f"{query}() disagrees with the {cap!r} claim"
