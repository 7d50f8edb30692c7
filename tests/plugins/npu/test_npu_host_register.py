"""npu host registration: npuHostRegister with MAPPED, 4096-byte rounding, refcount, failure paths."""

from __future__ import annotations

import polyaccel
import pytest
import torch
from polyaccel import PolyaccelError, Unsupported
from polyaccel.host_registration import LEAKED_HOST_BUFFERS as _LEAKED_HOST_BUFFERS
from polyaccel.plugins.npu import emulation as emulated_npu
from polyaccel.testing.emulation import emulate

MAPPED = emulated_npu.ACL_HOST_REG_MAPPED


def _odd_buffer(n=3001):
    """A host tensor that neither starts nor ends on a 4096-byte boundary."""
    base = torch.randn(n + 5)
    t = base[5:]
    assert t.data_ptr() % 4096 != 0
    return t


def test_registration_uses_mapped_and_rounds_the_range_to_4096():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        assert acc.pin_memory_alignment() == 4096
        t = _odd_buffer()
        assert acc.register_host_memory(t) is t, "registration is in place: no copy"
        call = rt.calls.last("npuHostRegister")
        ptr, nbytes, flags = call.args
        assert flags == MAPPED and call.result == 0
        assert ptr % 4096 == 0 and nbytes % 4096 == 0
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert ptr <= start and end <= ptr + nbytes, "the rounded range must cover the whole tensor"
        assert ptr > start - 4096 and ptr + nbytes < end + 4096, "rounded by at most one page on each side"
        assert rt.npurt.registered == {ptr: (nbytes, MAPPED)}
        assert acc.is_pinned(t)


def test_registration_is_refcounted_and_idempotent():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        t = _odd_buffer()
        acc.register_host_memory(t)
        acc.register_host_memory(t)
        assert rt.calls.count_of("npuHostRegister") == 1
        assert acc.host_registrations() == {t.data_ptr(): 2}
        assert acc.unregister_host_memory(t) is False, "first release only drops a reference"
        assert rt.calls.count_of("npuHostUnregister") == 0 and rt.npurt.registered
        assert acc.unregister_host_memory(t) is True
        assert rt.calls.count_of("npuHostUnregister") == 1 and rt.npurt.registered == {}
        assert acc.host_registrations() == {} and not acc.is_pinned(t)
        with pytest.raises(PolyaccelError, match="was not registered"):
            acc.unregister_host_memory(t)


def test_refused_registration_raises_with_the_acl_code_and_records_nothing():
    with emulate("npu", registration_refused=207000) as rt:
        acc = polyaccel.get_accelerator()
        t = _odd_buffer()
        with pytest.raises(PolyaccelError, match="ACL error 207000"):
            acc.register_host_memory(t)
        assert acc.host_registrations() == {} and rt.npurt.registered == {}


def test_failed_unregister_keeps_the_memory_alive():
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        t = _odd_buffer()
        ptr = t.data_ptr()
        acc.register_host_memory(t)
        rt.faults.unregister_fails = True
        leaked_before = len(_LEAKED_HOST_BUFFERS)
        with pytest.raises(PolyaccelError, match="kept alive"):
            acc.unregister_host_memory(t)
        assert rt.calls.last("npuHostUnregister").result == emulated_npu.ACL_ERROR_RT_PARAM_INVALID
        assert len(_LEAKED_HOST_BUFFERS) == leaked_before + 1
        leaked = _LEAKED_HOST_BUFFERS[-1]
        assert leaked.leaked and leaked.tensor.data_ptr() == ptr, "the buffer must stay referenced, never freed"
        assert rt.npurt.registered, "the runtime still holds the registration"
        del t
        assert leaked.tensor.data_ptr() == ptr


def test_without_npurt_registration_is_unsupported_with_the_reason():
    with emulate("npu", no_npurt=True):
        acc = polyaccel.get_accelerator()
        assert "host_register" not in acc.capabilities()
        assert "npurt is unavailable" in acc.host_register_unavailable_reason()
        with pytest.raises(Unsupported, match="npurt is unavailable") as info:
            acc.register_host_memory(torch.randn(100))
        assert "npu" in str(info.value)


def test_runtime_initialisation_failure_is_a_reason_not_a_crash():
    with emulate("npu", npurt_init_fails=True):
        acc = polyaccel.get_accelerator()
        assert "host_register" not in acc.capabilities()
        with pytest.raises(Unsupported, match="failed to initialise"):
            acc.register_host_memory(torch.randn(100))


def test_the_emulated_runtime_enforces_mapped_alignment():
    """The stand-in must refuse what ACL refuses, or the plugin's rounding would go untested."""
    with emulate("npu") as rt:
        binding = torch.npu.npurt()
        assert binding is torch.npu.npurt(), "npurt() returns one binding"
        t = torch.empty(3 * 4096, dtype=torch.uint8)
        aligned = -(-t.data_ptr() // 4096) * 4096
        assert binding.npuHostRegister(aligned + 8, 4096, MAPPED) == emulated_npu.ACL_ERROR_RT_PARAM_INVALID
        assert binding.npuHostRegister(aligned, 100, MAPPED) == emulated_npu.ACL_ERROR_RT_PARAM_INVALID
        assert binding.npuHostRegister(0, 4096, MAPPED) == emulated_npu.ACL_ERROR_INVALID_PARAM
        assert binding.npuHostRegister(aligned + 8, 100, emulated_npu.ACL_HOST_REG_PINNED) == 0
        assert binding.npuHostUnregister(aligned + 8) == 0
        assert binding.npuHostUnregister(aligned + 8) != 0
        assert rt.calls.count_of("npuHostRegister") == 4


def test_two_buffers_on_one_page_fail_clearly_instead_of_silently():
    """Rounding to 4096 makes small neighbours overlap; ACL refuses the second range and so must we."""
    with emulate("npu") as rt:
        acc = polyaccel.get_accelerator()
        storage = torch.randn(512)
        first, second = storage[:100], storage[200:300]
        acc.register_host_memory(first)
        with pytest.raises(PolyaccelError, match="not overlap a registered range"):
            acc.register_host_memory(second)
        assert acc.host_registrations() == {first.data_ptr(): 1}
        assert len(rt.npurt.registered) == 1
        acc.unregister_host_memory(first)
        assert rt.npurt.registered == {}
