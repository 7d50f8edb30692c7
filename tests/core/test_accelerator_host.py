"""The contract names no device, and the host's answers live in HostAccelerator: the cpu and example plugins
derive from it, the device-generic base asks the device module instead, and a contract-1.1 class with the
host's device type keeps the host's answers through discovery."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import polyaccel
import pytest
import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.errors import InvalidArgument, Unsupported
from polyaccel.hookspecs import hookimpl
from polyaccel.host_accelerator import HostAccelerator, with_host_defaults

ROOT = Path(__file__).resolve().parents[2]
#: the contract (with its host-memory part) and its defaults' plumbing: none may ask which device it serves
DEVICE_GENERIC_FILES = ("core/accelerator.py", "core/host_registration.py", "core/device_generic.py")
_IDENTITY = {"device_type", "name"}


def _is_identity(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in _IDENTITY) or (
        isinstance(node, ast.Name) and node.id in _IDENTITY)


def _has_literal(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


def identity_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison of ``device_type`` or ``name`` with a string literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_identity(s) for s in sides) and any(_has_literal(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "endswith"):
            if _is_identity(node.func.value):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_branch_check_sees_comparisons_with_a_device_name():
    source = '''
def device(self):
    if self.device_type == "cpu":
        return 0
    if device_type in ("xpu", "npu") or "mps" != self.name or self.device_type.startswith("cu"):
        return 1
    return self.device_type == other.device_type  # two identities, no literal: fine
'''
    assert [line for line, _ in identity_branches(source)] == [3, 5, 5, 5]


@pytest.mark.parametrize("rel", DEVICE_GENERIC_FILES)
def test_the_contract_and_its_defaults_branch_on_no_device_name(rel):
    found = identity_branches((ROOT / rel).read_text())
    assert not found, f"{rel} branches on a device name (the host's answers go in HostAccelerator): {found}"


# ------------------------------------------------------------------ the host's answers
class Host(HostAccelerator):
    name = "testhost"

    def probe(self):
        return ProbeResult(True, "", 1)


class HostRng(Host):
    def capabilities(self):
        return frozenset({"rng"})


def test_host_accelerator_answers_for_one_host_device_per_process(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    acc = Host()
    assert (acc.device_type, acc.communication_backend) == ("cpu", "gloo")
    assert acc.device() == acc.device(5) == torch.device("cpu")
    assert (acc.device_count(), acc.current_device()) == (1, 0)
    acc.set_device(0)
    acc.set_device(3)  # this rank's LOCAL_RANK: its one host device
    refusal = "^testhost has one host device per process; cannot select device 2$"
    with pytest.raises(InvalidArgument, match=refusal):
        acc.set_device(2)
    acc.synchronize()
    acc.synchronize(0)
    acc.empty_cache()
    flags = (acc.is_synchronized_device(), acc.use_host_timers(), acc.resolves_data_dependency(),
             acc.handles_memory_backpressure())
    assert flags == (True, True, True, True)
    t = torch.randn(3)
    assert acc.on_accelerator(t) and not acc.on_accelerator(torch.empty(1, device="meta"))


def test_host_rng_is_torchs_default_generator_and_only_when_claimed():
    acc = Host()
    calls = (lambda: acc.manual_seed(1), lambda: acc.manual_seed_all(1), acc.initial_seed, acc.get_rng_state,
             lambda: acc.set_rng_state(torch.get_rng_state()))
    for call in calls:
        with pytest.raises(Unsupported, match="'testhost' does not support rng"):
            call()
    rng = HostRng()
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for seed_call in (rng.manual_seed, rng.manual_seed_all):
        seed_call(seed)
        reference = torch.randn(5, generator=torch.Generator().manual_seed(seed))
        assert rng.initial_seed() == seed and torch.equal(torch.randn(5), reference)
    state = rng.get_rng_state(0)
    drawn = torch.randn(7)
    rng.set_rng_state(state, 0)
    assert torch.equal(torch.randn(7), drawn)


def test_host_accelerator_keeps_the_base_guards_for_what_the_host_does_not_claim():
    acc = Host()
    for call in (acc.Stream, acc.Event, acc.create_graph, acc.memory_allocated,
                 lambda: acc.register_host_memory(torch.ones(2))):
        with pytest.raises(Unsupported):
            call()
    assert not acc.is_pinned(torch.ones(2)) and acc.host_registrations() == {}
    assert acc.supported_dtypes() == (torch.float32,)


def test_the_base_asks_the_device_module_where_the_host_answers_by_itself():
    """On the device-generic base the same calls reach the device module; its flags are a device's."""
    calls = []
    module = SimpleNamespace(
        device_count=lambda: 4, current_device=lambda: 2, set_device=lambda i: calls.append(("set", i)),
        synchronize=lambda i: calls.append(("sync", i)), empty_cache=lambda: calls.append("empty"),
        manual_seed=lambda s: calls.append(("seed", s)),
        manual_seed_all=lambda s: calls.append(("seed_all", s)))

    class Device(Accelerator):
        name = "moduledev"
        device_type = "meta"

        def capabilities(self):
            return frozenset({"rng"})

        def _device_module(self, required=True):
            return module

    acc = Device()
    assert (acc.device(), acc.device(1)) == (torch.device("meta", 2), torch.device("meta", 1))
    assert acc.device_count() == 4
    acc.set_device(3)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(5)
    acc.manual_seed_all(6)
    assert calls == [("set", 3), ("sync", None), "empty", ("seed", 5), ("seed_all", 6)]
    flags = (acc.is_synchronized_device(), acc.use_host_timers(), acc.resolves_data_dependency(),
             acc.handles_memory_backpressure())
    assert flags == (False, False, False, False)


# ------------------------------------------------------------------ the plugins that are the host
def test_the_cpu_and_example_plugins_are_host_accelerators():
    from polyaccel.plugins.cpu.accelerator import CpuAccelerator

    assert issubclass(CpuAccelerator, HostAccelerator)
    assert polyaccel.HostAccelerator is HostAccelerator
    selected = polyaccel.set_accelerator("cpu")
    assert isinstance(selected, HostAccelerator) and selected.device() == torch.device("cpu")
    example = pytest.importorskip("polyaccel_example_plugin.accelerator")
    assert issubclass(example.ExampleAccelerator, HostAccelerator)


# ------------------------------------------------------------------ contract 1.1 host-backed classes
class LegacyHost(Accelerator):
    """Written for contract 1.1: the host's device type on the base class, one override of its own."""

    name = "legacyhost"
    device_type = "cpu"
    priority = -20

    def probe(self):
        return ProbeResult(True, "", 1)

    def capabilities(self):
        return frozenset({"rng"})

    def initial_seed(self):
        return 1234


def test_with_host_defaults_puts_the_host_beneath_a_legacy_class_only():
    adopted = with_host_defaults(LegacyHost)
    assert adopted.__mro__[1:3] == (LegacyHost, HostAccelerator)
    assert (adopted.__name__, adopted.__qualname__, adopted.__module__) == (
        "LegacyHost", LegacyHost.__qualname__, LegacyHost.__module__)
    acc = adopted()
    assert isinstance(acc, LegacyHost) and acc.initial_seed() == 1234  # its own method wins
    assert acc.device() == torch.device("cpu") and acc.is_synchronized_device()
    assert with_host_defaults(HostRng) is HostRng

    class Device(Accelerator):
        name = "dev"
        device_type = "meta"

    assert with_host_defaults(Device) is Device


def test_discovery_gives_a_legacy_host_class_the_hosts_answers():
    class Plugin:
        POLYACCEL_API_VERSION = "1.1"

        @hookimpl
        def polyaccel_accelerators(self):
            return [LegacyHost]

    polyaccel.register_plugin("legacyhost", Plugin())
    acc = polyaccel.set_accelerator("legacyhost")
    assert isinstance(acc, LegacyHost) and isinstance(acc, HostAccelerator)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    acc.manual_seed(seed)
    assert torch.equal(torch.randn(4), torch.randn(4, generator=torch.Generator().manual_seed(seed)))
    assert (acc.device_count(), acc.current_device(), acc.use_host_timers()) == (1, 0, True)
