"""Every op the accelerator's device type gets, checked against the core reference.

For each op: the builder the registry chooses for the device type, and every other
compatible builder the plugin itself contributes (a lower-ranked one is still code its
users can force with an override). One row per (op, builder, dtype); dtypes are those the
op is defined for that the accelerator claims.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from polyaccel.errors import PolyaccelError
from polyaccel.testing.conformance import (
    opcases,
    opcases_loss,
    opcases_model,
    opcases_moe,
    opcases_muon,
    opcases_muon_passes,
)


@dataclass(frozen=True)
class OpCase:
    op: str
    builder: str
    plugin: str
    chosen: bool
    dtype: torch.dtype | None
    skip: str = ""

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "-"
        return f"{self.op}-{self.builder}-{dt}"


def op_cases(target) -> list[OpCase]:
    from polyaccel.ops import registry

    acc = target.accelerator
    dtypes = acc.supported_dtypes()
    cases: list[OpCase] = []
    for op in registry.ops():
        try:
            cands = registry.candidates(op, acc.device_type)
        except Exception as exc:  # noqa: BLE001 - an op the registry cannot rank is a failure to show
            cases.append(OpCase(op, "?", "?", True, None, skip=f"FAIL:{type(exc).__name__}: {exc}"))
            continue
        if op not in opcases.OP_DTYPES:
            cases.append(OpCase(op, "-", "-", True, None, skip=f"no conformance check exists for op {op!r}"))
            continue
        op_dtypes = [d for d in opcases.OP_DTYPES[op] if d in dtypes]
        for c in cands:
            b = c.builder
            if not b.serves(acc.device_type):
                continue
            mine = b.plugin in target.plugin_names
            if not c.chosen and not mine:
                continue
            if not c.chosen and c.reason.startswith("incompatible"):
                cases.append(OpCase(op, b.name, b.plugin, False, None,
                                    skip=f"builder {b.name!r} of this plugin is {c.reason}"))
                continue
            if c.chosen and b.plugin == "core" and acc.device_type == "cpu":
                cases.append(OpCase(op, b.name, b.plugin, True, None,
                                    skip="served by the core reference on the host (no builder of this plugin); "
                                         "nothing plugin-specific to verify"))
                continue
            cases += [OpCase(op, b.name, b.plugin, c.chosen, d) for d in op_dtypes]
    return cases


def pytest_generate_tests(metafunc):
    if "op_case" not in metafunc.fixturenames:
        return
    from polyaccel.testing.conformance.plugin import get_target

    params = []
    for case in op_cases(get_target(metafunc.config)):
        variant = f"{case.builder} ({case.plugin}{', chosen' if case.chosen else ''})"
        if case.dtype is not None:
            variant += f" {str(case.dtype).removeprefix('torch.')}"
        marks = [pytest.mark.conformance(area="op", subject=case.op, check="vs_reference", variant=variant)]
        if case.skip and not case.skip.startswith("FAIL:"):
            marks.append(pytest.mark.skip(reason=case.skip))
        params.append(pytest.param(case, id=case.id, marks=marks))
    metafunc.parametrize("op_case", params)


def test_op(conformance_target, op_case: OpCase):
    if op_case.skip.startswith("FAIL:"):
        pytest.fail(f"the registry cannot rank builders of {op_case.op!r}: {op_case.skip[5:]}")
    from polyaccel.ops import registry

    acc = conformance_target.accelerator
    builder = next(b for b in registry.builders(op_case.op) if b.name == op_case.builder)
    fn = builder.load()
    if op_case.chosen:
        assert registry.resolve(op_case.op, acc.device_type) is fn, (
            f"registry.resolve({op_case.op!r}) does not return the chosen builder {op_case.builder!r}")
    device = acc.device()
    fp8 = acc.has("fp8")
    seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    torch.manual_seed(seed)  # fresh inputs every run; the seed is in the failure message to replay one
    try:
        _check(op_case, fn, device, fp8)
    except AssertionError as exc:
        raise AssertionError(f"{exc} [torch.manual_seed({seed})]") from None
    except (ValueError, TypeError, NotImplementedError, PolyaccelError) as exc:
        # A builder users reach only through an override may refuse a dtype, if it says so clearly.
        # The chosen builder may not: polyaccel.ops.<op> would fail where the reference works.
        if not op_case.chosen and str(op_case.dtype) in str(exc):
            pytest.skip(f"builder {op_case.builder!r} (not chosen; reachable through an override) refuses "
                        f"{op_case.dtype}: {exc}")
        raise
    acc.synchronize()


def _check(op_case: OpCase, fn, device, fp8: bool) -> None:
    if op_case.op in ("fused_adam", "fused_lion", "fused_lamb"):
        opcases.check_optimizer(op_case.op, fn, device, op_case.dtype)
    elif op_case.op == "quantize":
        opcases.check_quantize(fn, device, op_case.dtype, fp8)
    elif op_case.op == "dequantize":
        opcases.check_dequantize(fn, device, op_case.dtype, fp8)
    elif op_case.op == "swiglu":
        opcases.check_swiglu(fn, device, op_case.dtype)
    elif op_case.op == "weighted_swiglu":
        opcases.check_weighted_swiglu(fn, device, op_case.dtype)
    elif op_case.op == "grouped_mm":
        opcases.check_grouped_mm(fn, device, op_case.dtype)
    elif op_case.op == "gather_sum":
        opcases.check_gather_sum(fn, device, op_case.dtype)
    elif op_case.op == "newton_schulz":
        opcases_muon.check_newton_schulz(fn, device, op_case.dtype)
    elif op_case.op == "fused_muon":
        opcases_muon.check_fused_muon(fn, device, op_case.dtype)
    elif op_case.op in opcases_muon_passes.CHECKS:
        opcases_muon_passes.CHECKS[op_case.op](fn, device, op_case.dtype)
    elif op_case.op == "moe_gate_up":
        opcases_moe.check_moe_gate_up(fn, device, op_case.dtype)
    elif op_case.op == "moe_down_combine":
        opcases_moe.check_moe_down_combine(fn, device, op_case.dtype)
    elif op_case.op == "rms_norm":
        opcases_model.check_rms_norm(fn, device, op_case.dtype)
    elif op_case.op == "rope":
        opcases_model.check_rope(fn, device, op_case.dtype)
    elif op_case.op in opcases_loss.CHECKS:
        opcases_loss.CHECKS[op_case.op](fn, device, op_case.dtype)
    else:  # pragma: no cover - op_cases() only yields ops with a check
        pytest.fail(f"no check for op {op_case.op!r}")
