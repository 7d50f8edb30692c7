"""One test per capability: a claimed capability must work, an unclaimed one must say so.

"Say so" means raising :class:`polyaccel.Unsupported` naming the plugin for the features
that have an API (streams, events, graphs, host_register, pinned, memory_stats, rng).
The dtype and triton capabilities are declarations: unclaimed, the accelerator's own
queries (``supported_dtypes()``, ``fp8_dtypes()``, ``is_triton_supported()``) must agree.
"""

from __future__ import annotations

import pytest
import torch
from polyaccel.accelerator import KNOWN_CAPABILITIES
from polyaccel.errors import PolyaccelError
from polyaccel.testing.conformance.checks import CHECKED_CAPABILITIES, claim, expect_unsupported
from polyaccel.testing.numerics import assert_close_to_reference


def cap(name: str, check: str):
    return pytest.mark.conformance(area="capability", subject=name, check=check)


# --------------------------------------------------------------------------- streams / events
@cap("streams", "ordering")
def test_streams(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "streams"):
        msgs = [expect_unsupported(acc, acc.Stream, "Stream()", "streams"),
                expect_unsupported(acc, acc.current_stream, "current_stream()", "streams")]
        conformance_row.unsupported_verified(msgs[0])
        return
    dev = acc.device()
    x_host = torch.randn(384, 384)
    x = x_host.to(dev)
    producer, consumer = acc.Stream(), acc.Stream()
    producer.wait_stream(acc.current_stream())
    with acc.stream(producer):
        assert acc.current_stream() == producer, "stream(s) did not make s the current stream"
        y = x
        for _ in range(6):  # enough work that a missing dependency shows
            y = torch.tanh(y @ x) * 0.5
    consumer.wait_stream(producer)
    with acc.stream(consumer):
        z = y + 1.0
    acc.current_stream().wait_stream(consumer)
    acc.synchronize()
    # the same work on the host: a missing dependency gives unrelated numbers, not rounding noise
    yr = x_host
    for _ in range(6):
        yr = torch.tanh(yr @ x_host) * 0.5
    assert_close_to_reference(z, yr + 1.0, torch.float32, "work ordered across two streams", rtol=2e-3, atol=2e-3)


@cap("events", "record_wait_query")
def test_events(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "events"):
        conformance_row.unsupported_verified(expect_unsupported(acc, acc.Event, "Event()", "events"))
        return
    dev = acc.device()
    x_host = torch.randn(256, 256)
    x = x_host.to(dev)
    y = torch.relu(x @ x)
    done = acc.Event()
    done.record()
    if acc.has("streams"):
        side = acc.Stream()
        side.wait_event(done)
        with acc.stream(side):
            z = y * 2.0
        acc.current_stream().wait_stream(side)
    else:
        z = y * 2.0
    done.synchronize()
    assert done.query(), "event.query() is False after event.synchronize()"
    acc.synchronize()
    expected = torch.relu(x_host @ x_host) * 2.0
    assert_close_to_reference(z, expected, torch.float32, "work ordered by an event", rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------- graphs
@cap("graphs", "capture_replay_recomputes")
def test_graphs(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "graphs"):
        msgs = [expect_unsupported(acc, acc.create_graph, "create_graph()", "graphs"),
                expect_unsupported(acc, lambda: acc.capture_to_graph(None), "capture_to_graph()", "graphs"),
                expect_unsupported(acc, lambda: acc.replay_graph(None), "replay_graph()", "graphs")]
        conformance_row.unsupported_verified(msgs[0])
        return
    dev = acc.device()
    x0, w = torch.randn(1031), torch.randn(1031)
    static_x, static_w = x0.to(dev, copy=True), w.to(dev, copy=True)
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        static_y = static_x * static_w + 1.0
    acc.replay_graph(graph)
    acc.synchronize()
    assert_close_to_reference(static_y, x0.double() * w.double() + 1.0, torch.float32, "first replay")
    for round_ in range(2):
        x_new = torch.randn(1031)
        static_x.copy_(x_new.to(dev))
        acc.replay_graph(graph)
        acc.synchronize()
        got = static_y.detach().cpu().double()
        want = x_new.double() * w.double() + 1.0
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            stale = torch.allclose(got, x0.double() * w.double() + 1.0, rtol=1e-5, atol=1e-6)
            pytest.fail(
                f"replay {round_ + 2} after changing the static input did not recompute"
                + (": the output still holds the captured inputs' result (stale replay)" if stale else
                   f": max error {float((got - want).abs().max()):.3e}"))


@cap("graphs", "replay_without_capture_errors")
def test_graph_replay_without_capture(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "graphs"):
        msg = expect_unsupported(acc, lambda: acc.replay_graph(acc.create_graph()), "replay_graph(create_graph())",
                                 "graphs")
        conformance_row.unsupported_verified(msg)
        return
    graph = acc.create_graph()
    try:
        acc.replay_graph(graph)
        acc.synchronize()
    except Exception as exc:  # noqa: BLE001 - any clear error is right
        assert str(exc).strip(), f"replaying an uncaptured graph raised {type(exc).__name__} with no message"
        conformance_row.note(f"{type(exc).__name__}: {exc}")
        return
    pytest.fail("replay_graph() of a graph that was never captured returned normally (a silent no-op); "
                "it must raise an error saying the graph was not captured")


# ------------------------------------------------------------------------ host memory
def _odd_view(n: int = 1000, skip: int = 3) -> torch.Tensor:
    """A contiguous host tensor whose data does not start on an alignment boundary."""
    return torch.randn(n + skip)[skip:]


def _page_isolated(like: torch.Tensor, align: int) -> torch.Tensor:
    """An empty host tensor shaped like ``like`` whose aligned range lies inside its own allocation.

    Two small allocations can share an alignment page; a runtime that registers whole pages
    (Ascend: 4096 bytes) rightly refuses the second, overlapping range, so the buffer the check
    registers next to ``buf`` must own its pages.
    """
    slack = -(-align // like.element_size())
    storage = torch.empty(like.numel() + 2 * slack, dtype=like.dtype)
    start = (-storage.data_ptr() % align) // like.element_size()
    return storage[start:start + like.numel()].view(like.shape)


@cap("host_register", "register_use_unregister")
def test_host_register(conformance_target, conformance_row, monkeypatch):
    acc = conformance_target.accelerator
    buf = _odd_view()
    if not claim(conformance_target, conformance_row, "host_register"):
        msgs = [expect_unsupported(acc, lambda: acc.register_host_memory(buf), "register_host_memory(t)",
                                   "host_register"),
                expect_unsupported(acc, lambda: acc.unregister_host_memory(buf), "unregister_host_memory(t)",
                                   "host_register")]
        conformance_row.unsupported_verified(msgs[0])
        return
    calls = {"register": 0, "unregister": 0}
    real_register, real_unregister = acc._host_register, acc._host_unregister

    def counting_register(ptr, nbytes):
        calls["register"] += 1
        return real_register(ptr, nbytes)

    def counting_unregister(ptr):
        calls["unregister"] += 1
        return real_unregister(ptr)

    monkeypatch.setattr(acc, "_host_register", counting_register)
    monkeypatch.setattr(acc, "_host_unregister", counting_unregister)

    align = acc.pin_memory_alignment()
    assert isinstance(align, int) and align >= 1 and align & (align - 1) == 0, (
        f"pin_memory_alignment() must be a power of two, got {align!r}")
    before = buf.clone()
    ptr = buf.data_ptr()
    out = acc.register_host_memory(buf)
    assert out.data_ptr() == ptr, "register_host_memory copied the buffer; it must register it in place"
    assert acc.host_registrations().get(ptr) == 1, f"registrations after one register: {acc.host_registrations()}"
    lo, nbytes = acc.host_register_range(buf)
    assert lo % align == 0 and nbytes % align == 0, (
        f"registered range ({lo:#x}, {nbytes}) is not aligned to {align} bytes")
    assert lo <= ptr and ptr + buf.numel() * buf.element_size() <= lo + nbytes, "registered range misses the buffer"
    assert acc.is_pinned(buf), "is_pinned() is False for a registered buffer"
    acc.register_host_memory(buf)  # idempotent: counts, the runtime sees one registration
    assert acc.host_registrations().get(ptr) == 2, "a second register of the same buffer must count"
    assert calls["register"] <= 1, f"the runtime hook ran {calls['register']} times for one buffer"
    try:
        dev = acc.device()
        on_device = buf.to(dev, non_blocking=True)
        landing = _page_isolated(before, align)
        acc.register_host_memory(landing)
        try:
            landing.copy_(on_device * 1.0, non_blocking=True)
            acc.synchronize()
            assert torch.equal(landing, before), "host -> device -> host copy through registered buffers changed data"
        finally:
            assert acc.unregister_host_memory(landing) is True
    finally:
        first = acc.unregister_host_memory(buf)
        last = acc.unregister_host_memory(buf)
    assert first is False and last is True, (
        f"unregister must drop one reference at a time (got {first}, {last}), telling the runtime on the last")
    assert ptr not in acc.host_registrations(), "the buffer is still listed after the last unregister"
    assert calls["unregister"] <= calls["register"] + 1
    assert torch.equal(buf, before), "registration changed the buffer's contents"
    with pytest.raises(PolyaccelError):
        acc.unregister_host_memory(buf)
    empty = torch.empty(0)
    acc.register_host_memory(empty)  # zero-size: nothing to register, no error
    acc.unregister_host_memory(empty)


@cap("pinned", "pin_memory_is_pinned")
def test_pinned(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    host = torch.randn(777)
    if not claim(conformance_target, conformance_row, "pinned"):
        msg = expect_unsupported(acc, lambda: acc.pin_memory(host), "pin_memory(t)", "pinned")
        assert not acc.is_pinned(host), "is_pinned() is True on a plain tensor although 'pinned' is not claimed"
        conformance_row.unsupported_verified(msg)
        return
    pinned = acc.pin_memory(host)
    assert acc.is_pinned(pinned), "is_pinned(pin_memory(t)) is False"
    assert torch.equal(pinned, host), "pin_memory changed the data"
    assert acc.pin_memory(pinned) is pinned, "pin_memory of a pinned tensor must return it unchanged"
    empty = acc.empty_pinned((5, 7), torch.float32)
    assert empty.shape == (5, 7) and acc.is_pinned(empty), "empty_pinned() did not return a pinned buffer"
    d = pinned.to(acc.device(), non_blocking=True)
    empty.view(-1)[:35].copy_(d[:35], non_blocking=True)
    acc.synchronize()
    assert torch.equal(empty.view(-1)[:35], host[:35]), "copy through pinned buffers changed the data"


# --------------------------------------------------------------------------------- memory
@cap("memory_stats", "allocated_peak_reserved")
def test_memory_stats(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "memory_stats"):
        msgs = [expect_unsupported(acc, acc.memory_allocated, "memory_allocated()", "memory_stats"),
                expect_unsupported(acc, acc.max_memory_allocated, "max_memory_allocated()", "memory_stats")]
        conformance_row.unsupported_verified(msgs[0])
        return
    dev = acc.device()
    acc.synchronize()
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    nbytes = 4 << 20
    block = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    acc.synchronize()
    grown = acc.memory_allocated()
    assert grown >= base + nbytes, f"memory_allocated() grew by {grown - base} bytes for a {nbytes}-byte tensor"
    peak = acc.max_memory_allocated()
    assert peak >= grown, f"max_memory_allocated() {peak} < memory_allocated() {grown}"
    assert acc.memory_reserved() >= grown, "memory_reserved() is below memory_allocated()"
    del block
    acc.synchronize()
    assert acc.memory_allocated() <= grown - nbytes + (1 << 20), "freeing the tensor did not lower memory_allocated()"
    assert acc.max_memory_allocated() >= peak, "the peak counter went down without a reset"
    assert isinstance(acc.memory_stats(), dict)


# ------------------------------------------------------------------------------------ rng
@cap("rng", "seed_reproducible_state_roundtrip")
def test_rng(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "rng"):
        conformance_row.unsupported_verified(
            expect_unsupported(acc, lambda: acc.manual_seed(1234), "manual_seed()", "rng"))
        return
    dev = acc.device()
    acc.manual_seed(1234)
    a = torch.randn(97, device=dev)
    acc.manual_seed(1234)
    b = torch.randn(97, device=dev)
    assert torch.equal(a, b), "the same seed gave different numbers"
    acc.manual_seed(4321)
    c = torch.randn(97, device=dev)
    assert not torch.equal(a, c), "different seeds gave the same numbers (the seed is ignored)"
    state = acc.get_rng_state()
    assert isinstance(state, torch.Tensor), f"get_rng_state() returned {type(state).__name__}"
    d = torch.randn(97, device=dev)
    acc.set_rng_state(state)
    e = torch.randn(97, device=dev)
    assert torch.equal(d, e), "set_rng_state(get_rng_state()) did not restore the generator"


# ------------------------------------------------------------------------------- dtypes
_DTYPES = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("capability", [pytest.param(c, marks=cap(c, "arithmetic")) for c in sorted(_DTYPES)])
def test_dtype(conformance_target, conformance_row, capability):
    acc = conformance_target.accelerator
    dtype = _DTYPES[capability]
    if not claim(conformance_target, conformance_row, capability):
        assert dtype not in acc.supported_dtypes(), (
            f"{dtype} is in supported_dtypes() but {capability!r} is not claimed")
        conformance_row.unsupported_verified(f"not claimed; {dtype} is absent from supported_dtypes()")
        return
    a = torch.randn(333).to(dtype)
    b = torch.randn(333).to(dtype)
    got = a.to(acc.device()) * 2 + b.to(acc.device())
    assert got.dtype == dtype
    assert_close_to_reference(got, a.double() * 2 + b.double(), dtype, f"{dtype} arithmetic on the device")
    if dtype == torch.float64:
        m = torch.randn(17, 19, dtype=dtype)
        prod = m.to(acc.device()) @ m.to(acc.device()).T
        assert_close_to_reference(prod, m @ m.T, dtype, "float64 matmul", rtol=1e-10, atol=1e-10)


@cap("fp8", "cast_roundtrip")
def test_fp8(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "fp8"):
        assert acc.fp8_dtypes() == (), f"fp8_dtypes() is {acc.fp8_dtypes()} but 'fp8' is not claimed"
        conformance_row.unsupported_verified("not claimed; fp8_dtypes() is empty")
        return
    dtypes = acc.fp8_dtypes()
    assert dtypes, "'fp8' is claimed but fp8_dtypes() is empty"
    x = torch.randn(517) * 8
    for dt in dtypes:
        assert dt.is_floating_point and dt.itemsize == 1, f"fp8_dtypes() lists {dt}, not an 8-bit float"
        on_device = x.to(acc.device()).to(dt).to(torch.float32).cpu()
        assert torch.equal(on_device, x.to(dt).to(torch.float32)), f"{dt} cast on the device differs from torch's"


@cap("triton", "vector_add_kernel")
def test_triton(conformance_target, conformance_row):
    acc = conformance_target.accelerator
    if not claim(conformance_target, conformance_row, "triton"):
        assert not acc.is_triton_supported(), "is_triton_supported() is True but 'triton' is not claimed"
        conformance_row.unsupported_verified("not claimed; is_triton_supported() is False")
        return
    assert acc.is_triton_supported(), "'triton' is claimed but is_triton_supported() is False"
    from polyaccel.testing.conformance import triton_probe

    x, y = torch.randn(1000), torch.randn(1000)
    out = triton_probe.add(x.to(acc.device()), y.to(acc.device()))
    acc.synchronize()
    assert_close_to_reference(out, x.double() + y.double(), torch.float32, "triton vector add")


# ---------------------------------------------------------------------------- the rest
def _unchecked(target) -> list[str]:
    return sorted((set(KNOWN_CAPABILITIES) | set(target.capabilities)) - CHECKED_CAPABILITIES)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_other_capability":
        return
    from polyaccel.testing.conformance.plugin import get_target

    names = _unchecked(get_target(metafunc.config))
    metafunc.parametrize("capability", [
        pytest.param(n, marks=pytest.mark.conformance(area="capability", subject=n, check="claimed"))
        for n in names] or [pytest.param("", marks=pytest.mark.skip(reason="every capability has a check"))])


def test_other_capability(conformance_target, conformance_row, capability):
    claimed = claim(conformance_target, conformance_row, capability)
    pytest.skip(f"no conformance check exists for capability {capability!r} "
                f"({'claimed' if claimed else 'not claimed'}); it is not verified")
