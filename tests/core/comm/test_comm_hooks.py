"""The comm-hooks contract, timeouts and init_distributed's use of them (one process, no process group)."""

from __future__ import annotations

import datetime

import polyaccel
import pytest
import torch
from polyaccel import ConfigError, comm, hookimpl
from polyaccel.accelerator import Accelerator
from polyaccel.comm import CommHooks, resolve_hooks
from polyaccel.report import build_report


class _Answers:
    POLYACCEL_API_VERSION = "1.0"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def polyaccel_comm_hooks(self, accelerator):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer(accelerator) if callable(self.answer) else self.answer


@pytest.fixture
def fake_init(monkeypatch):
    """Record init_process_group's arguments instead of creating a group."""
    calls = []
    monkeypatch.setattr(comm.session.dist, "init_process_group", lambda **kw: calls.append(kw))
    yield calls
    comm.destroy()


def test_defaults_come_from_the_accelerator():
    acc = polyaccel.get_accelerator()
    hooks = resolve_hooks(acc)
    assert hooks == CommHooks(backend="gloo")
    assert hooks.supports_device_tensors and not hooks.pass_device_id and not hooks.emulated_collectives
    assert not hooks.needs_staging(torch.ones(1), acc)


def test_first_non_none_answer_wins():
    polyaccel.register_plugin("silent", _Answers(None))
    polyaccel.register_plugin("vendor", _Answers(lambda acc: CommHooks(backend=f"{acc.name}-ccl",
                                                                        pass_device_id=True)))
    hooks = resolve_hooks(polyaccel.get_accelerator())
    assert hooks.backend == "cpu-ccl" and hooks.pass_device_id


def test_bad_answers_are_clear_errors():
    polyaccel.register_plugin("wrong", _Answers({"backend": "gloo"}))
    with pytest.raises(ConfigError, match="returned dict; return a polyaccel.comm.CommHooks"):
        resolve_hooks(polyaccel.get_accelerator())


def test_a_raising_hook_names_the_failure():
    polyaccel.register_plugin("raises", _Answers(RuntimeError("no comm library")))
    with pytest.raises(ConfigError, match="polyaccel_comm_hooks raised .*no comm library"):
        resolve_hooks(polyaccel.get_accelerator())


def test_comm_hooks_validate_their_fields():
    with pytest.raises(ConfigError, match="cannot emulate \\['all_gather'\\]"):
        CommHooks(backend="gloo", emulated_collectives={"all_gather"})
    with pytest.raises(ConfigError, match="backend"):
        CommHooks(backend="")
    hooks = CommHooks(backend="gloo", emulated_collectives=["reduce_scatter_tensor"])
    assert hooks.emulated_collectives == frozenset({"reduce_scatter_tensor"})
    with pytest.raises(AttributeError):
        hooks.backend = "nccl"  # frozen: swap the object, never mutate it


def test_staging_applies_to_the_accelerators_tensors_only():
    """What is staged is what the accelerator calls its own: device tensors, or host tensors for a host device."""

    class MetaDevice(Accelerator):
        name = "metadev"
        device_type = "meta"

    class HostDevice(Accelerator):
        name = "hostdev"

    mps_like = CommHooks(backend="gloo", supports_device_tensors=False)
    assert mps_like.stages and not mps_like.needs_staging(torch.ones(1), MetaDevice())
    assert mps_like.needs_staging(torch.ones(1, device="meta"), MetaDevice())
    assert mps_like.needs_staging(torch.ones(1), HostDevice())
    assert not CommHooks(backend="gloo").needs_staging(torch.ones(1, device="meta"), MetaDevice())


def test_timeout_default_env_argument_and_errors(monkeypatch):
    monkeypatch.delenv("POLYACCEL_COMM_TIMEOUT", raising=False)
    assert comm.resolve_timeout() == datetime.timedelta(minutes=10)
    monkeypatch.setenv("POLYACCEL_COMM_TIMEOUT", "12.5")
    assert comm.resolve_timeout() == datetime.timedelta(seconds=12.5)
    assert comm.resolve_timeout(3) == datetime.timedelta(seconds=3)
    assert comm.resolve_timeout(datetime.timedelta(minutes=2)) == datetime.timedelta(minutes=2)
    monkeypatch.setenv("POLYACCEL_COMM_TIMEOUT", "ten minutes")
    with pytest.raises(ConfigError, match="POLYACCEL_COMM_TIMEOUT='ten minutes' is not a number"):
        comm.resolve_timeout()
    monkeypatch.setenv("POLYACCEL_COMM_TIMEOUT", "-1")
    with pytest.raises(ConfigError, match="POLYACCEL_COMM_TIMEOUT must be a positive"):
        comm.resolve_timeout()
    with pytest.raises(ConfigError, match="timeout must be seconds or a datetime.timedelta"):
        comm.resolve_timeout("600")


def test_init_distributed_takes_backend_device_id_and_timeout_from_hooks(fake_init, monkeypatch):
    monkeypatch.delenv("POLYACCEL_COMM_TIMEOUT", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    polyaccel.register_plugin("vendor", _Answers(CommHooks(backend="fakeccl", pass_device_id=True)))
    comm.init_distributed()
    assert fake_init == [{"backend": "fakeccl", "init_method": "env://", "timeout": datetime.timedelta(minutes=10),
                          "device_id": torch.device("cpu")}]
    assert comm.active_hooks().backend == "fakeccl"
    assert comm.get_timeout() == datetime.timedelta(minutes=10)


def test_init_distributed_arguments_override(fake_init, monkeypatch):
    monkeypatch.setenv("POLYACCEL_COMM_TIMEOUT", "30")
    comm.init_distributed(timeout=5, init_method="tcp://127.0.0.1:1", rank=1, world_size=2)
    assert fake_init == [{"backend": "gloo", "init_method": "tcp://127.0.0.1:1", "rank": 1, "world_size": 2,
                          "timeout": datetime.timedelta(seconds=5)}]
    comm.destroy()
    comm.init_distributed(backend="mpi")
    assert fake_init[-1]["backend"] == "mpi" and fake_init[-1]["timeout"] == datetime.timedelta(seconds=30)


def test_uninitialised_process_is_a_world_of_one():
    assert not comm.is_initialized()
    assert comm.get_rank() == 0 and comm.get_world_size() == 1


def test_set_hooks_checks_its_argument():
    with pytest.raises(ConfigError, match="expects a polyaccel.comm.CommHooks"):
        comm.set_hooks("gloo")
    previous = comm.set_hooks(CommHooks(backend="gloo", supports_device_tensors=False))
    try:
        assert comm.dispatch.direct is False
    finally:
        comm.set_hooks(previous)
    assert comm.dispatch.direct is True


def test_report_shows_emulated_collectives_of_the_selected_plugin():
    polyaccel.register_plugin("vendor", _Answers(CommHooks(backend="gloo",
                                                           emulated_collectives={"reduce_scatter_tensor"})))
    info = build_report()["selected"]["comm"]
    assert info["backend"] == "gloo"
    assert list(info["emulated_collectives"]) == ["reduce_scatter_tensor"]
    assert "all_reduce" in info["emulated_collectives"]["reduce_scatter_tensor"]
