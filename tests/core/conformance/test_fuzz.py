"""The op-contract fuzz suite: planted stride-ignoring builders FAIL naming themselves, honest refusals
pass, and the cpu plugin's builders and the core references pass at CI's fixed budget."""

from __future__ import annotations

import pytest
import torch
from polyaccel.cli import build_parser, main
from polyaccel.errors import OpArgumentError
from polyaccel.ops import OpBuilder, registry
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.swiglu import make_swiglu, swiglu_backward, swiglu_forward
from polyaccel.plugins.cpu.accelerator import CpuAccelerator
from polyaccel.testing.conformance import fuzz, results
from polyaccel.testing.distributions import temporary_distribution

CPU_DTYPES = fuzz.fuzz_dtypes("fused_adam", CpuAccelerator().supported_dtypes())


def _flat(ts):
    """Each tensor's storage read as a dense run of numel elements from its offset: strides ignored."""
    return [t.as_strided((t.numel(),), (1,)) for t in ts]


def flat_adam(params, grads, exp_avgs, exp_avg_sqs, **kw):
    ref.fused_adam(_flat(params), _flat(grads), _flat(exp_avgs), _flat(exp_avg_sqs), **kw)


def _flat_swiglu_forward(gate, up):
    n = gate.numel()
    return swiglu_forward(gate.as_strided((n,), (1,)), up.as_strided((n,), (1,))).view(gate.shape)


def refuse_everything(params, grads, exp_avgs, **kw):
    raise OpArgumentError("fused_lion: this builder takes nothing")


def refuse_after_writing(params, grads, exp_avgs, **kw):
    for p in params:
        p.zero_()
    raise OpArgumentError("fused_lion: too late to refuse")


def crash(params, grads, exp_avgs, **kw):
    raise RuntimeError("kernel launch failed")


def _plant(op: str, name: str, fn) -> None:
    registry.ops()  # populate first: the planted builder joins the plugins' builders
    registry.add(OpBuilder(op=op, name=name, device_types=("cpu",), loader=lambda: fn, priority=-5,
                           description="planted by a test"))


@pytest.mark.parametrize("op,name,fn", [
    ("fused_adam", "planted_flat_adam", flat_adam),
    ("swiglu", "planted_flat_swiglu", make_swiglu(_flat_swiglu_forward, swiglu_backward)),
])
def test_stride_ignoring_builder_fails_naming_it_with_a_minimal_case(op, name, fn):
    _plant(op, name, fn)
    with pytest.raises(fuzz.FuzzFailure) as info:
        fuzz.check_builder(op, name, device="cpu", dtypes=CPU_DTYPES, examples=fuzz.DEFAULT_EXAMPLES)
    msg = str(info.value)
    assert f"{op} builder {name!r} FAILS" in msg, msg
    assert "minimal reproducer" in msg and "strides" in msg and "float32" in msg, msg
    # shrunk: the reproducer has a strided tensor (a step of 2 is the least non-contiguity) and small shapes
    assert "strides (2" in msg or ", 2)" in msg, msg
    assert registry._overrides.get(op) is None  # the override is restored


def test_an_honest_refusal_passes_and_a_dishonest_one_fails():
    _plant("fused_lion", "refuses", refuse_everything)
    stats = fuzz.check_builder("fused_lion", "refuses", device="cpu", dtypes=CPU_DTYPES, examples=10)
    assert stats.compared == 0 and stats.refused == stats.examples > 0
    assert "this builder takes nothing" in str(stats)

    _plant("fused_lion", "refuses_late", refuse_after_writing)
    with pytest.raises(fuzz.FuzzFailure, match=r"'refuses_late' FAILS: raised OpArgumentError .* but modified param 0"):
        fuzz.check_builder("fused_lion", "refuses_late", device="cpu", dtypes=CPU_DTYPES, examples=10)

    _plant("fused_lion", "crashes", crash)
    with pytest.raises(fuzz.FuzzFailure, match=r"'crashes' FAILS: raised RuntimeError: kernel launch failed"):
        fuzz.check_builder("fused_lion", "crashes", device="cpu", dtypes=CPU_DTYPES, examples=10)


#: a real defect the fuzz suite finds in torch_optim (the cpu plugin's optimizer builders): its
#: torch.lerp moment updates give NaN where the contract's beta * m + (1 - beta) * g gives ±Inf
#: (an Inf gradient with beta <= 0.5). Strict: the test fails once the builders are fixed.
CPU_ROWS = [("fused_adam", "cpu_fused_adam"), ("fused_lion", "cpu_fused_lion"), ("fused_lamb", "cpu_fused_lamb")]
#: the cpu plugin's model-layer builders
CPU_MODEL_ROWS = [("rms_norm", "cpu_rms_norm"), ("rope", "cpu_rope")]


@pytest.mark.parametrize("op,builder", [
    *CPU_ROWS,
    *CPU_MODEL_ROWS,
    *[(op, "reference") for op in ref.REFERENCE_OPS],
])
def test_cpu_builders_pass_at_the_ci_budget(op, builder):
    stats = fuzz.check_builder(op, builder, device="cpu", dtypes=fuzz.fuzz_dtypes(op, CPU_DTYPES),
                               examples=fuzz.DEFAULT_EXAMPLES, plugin="cpu")
    assert stats.compared > stats.examples // 2, str(stats)  # mostly compared, not refused


#: a plugin whose builders for the host ignore strides: one ranked above cpu's (chosen), one below
PLANTED = '''
from polyaccel.hookspecs import hookimpl
from polyaccel.ops import OpBuilder
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.swiglu import make_swiglu, swiglu_backward, swiglu_forward

POLYACCEL_API_VERSION = "1.0"


def _flat(ts):
    return [t.as_strided((t.numel(),), (1,)) for t in ts]


def flat_adam(params, grads, exp_avgs, exp_avg_sqs, **kw):
    ref.fused_adam(_flat(params), _flat(grads), _flat(exp_avgs), _flat(exp_avg_sqs), **kw)


def flat_forward(gate, up):
    n = gate.numel()
    return swiglu_forward(gate.as_strided((n,), (1,)), up.as_strided((n,), (1,))).view(gate.shape)


@hookimpl
def polyaccel_op_builders():
    return [OpBuilder(op="fused_adam", name="planted_flat_adam", device_types=("cpu",), loader=lambda: flat_adam,
                      priority=20),
            OpBuilder(op="swiglu", name="planted_flat_swiglu", device_types=("cpu",), priority=-1,
                      loader=lambda: make_swiglu(flat_forward, swiglu_backward))]
'''


def test_conformance_fuzz_fails_the_planted_builders(tmp_path, monkeypatch, capsys):
    out = tmp_path / "fuzz.json"
    with temporary_distribution(tmp_path / "site", "polyaccel-planted-plugin",
                                {"polyaccel.plugins": {"planted": "polyaccel_planted_plugin"}},
                                {"polyaccel_planted_plugin.py": PLANTED}):
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
        rc = main(["conformance", "--accelerator", "cpu", "--fuzz", "--fuzz-examples", "15", "--json", str(out),
                   "-k", "fuzz and (planted or swiglu or gather_sum)"])
    printed = capsys.readouterr().out
    assert rc == 1 and "DOES NOT CONFORM" in printed, printed
    rows = {r["id"]: r for r in results.load(str(out))["rows"]}
    assert set(rows) == {"op/fused_adam/fuzz[planted_flat_adam (planted, chosen)]",
                         "op/swiglu/fuzz[planted_flat_swiglu (planted)]",
                         "op/swiglu/fuzz[reference (core, chosen)]",
                         "op/weighted_swiglu/fuzz[reference (core, chosen)]",
                         "op/gather_sum/fuzz[reference (core, chosen)]"}, sorted(rows)
    for name, op in (("planted_flat_adam", "fused_adam"), ("planted_flat_swiglu", "swiglu")):
        row = next(r for r in rows.values() if name in r["variant"])
        assert row["status"] == "FAIL" and row["area"] == "op" and row["check"] == "fuzz", row
        assert f"{op} builder {name!r} (plugin planted) FAILS" in row["reason"], row["reason"]
        assert "minimal reproducer" in row["reason"] and "strides" in row["reason"], row["reason"]
        assert "Falsifying" not in row["reason"] and "Explanation" not in row["reason"], row["reason"]
    for rid in ("op/swiglu/fuzz[reference (core, chosen)]", "op/gather_sum/fuzz[reference (core, chosen)]"):
        assert rows[rid]["status"] == "PASS" and "15 drawn cases" in rows[rid]["reason"], rows[rid]


def test_fuzz_rows_only_with_fuzz(capsys):
    assert main(["conformance", "--accelerator", "cpu", "-k", "fuzz"]) == 2
    assert "no check ran" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--fuzz-examples", "5"], "--fuzz-examples applies to the fuzz rows; add --fuzz"),
    (["--fuzz-seed", "3"], "--fuzz-seed applies to the fuzz rows; add --fuzz"),
    (["--fuzz", "--fuzz-examples", "0"], "--fuzz-examples must be at least 1, got 0"),
])
def test_fuzz_option_errors(argv, message, capsys):
    assert main(["conformance", "--accelerator", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_explains_fuzz():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["conformance"]
    text = sub.format_help()
    for needle in ("--fuzz", "--fuzz-examples N", "--fuzz-seed S", "OpArgumentError", "minimal", "derandomized"):
        assert needle in text, needle


def test_fuzz_settings_are_reproducible_by_default():
    s = fuzz.fuzz_settings(30)
    assert s.max_examples == 30 and s.deadline is None and s.derandomize and s.database is None
    assert not fuzz.fuzz_settings(30, seed=7).derandomize
    with pytest.raises(ValueError, match="positive int"):
        fuzz.fuzz_settings(0)
    assert fuzz.fuzz_dtypes("quantize", [torch.float32, torch.float64]) == (torch.float32, torch.float64)


def test_optimizer_outputs_may_swap_nan_for_inf_but_never_lose_non_finiteness():
    from polyaccel.testing.conformance.fuzz_outcome import CaseFailure, close

    ref64 = torch.randn(8, dtype=torch.float64)
    ref64[2] = float("inf")
    swapped = ref64.clone()
    swapped[2] = float("nan")  # what torch's CUDA fused Adam writes for an infinite moment
    close(swapped, ref64, torch.float32, "exp_avg", non_finite_alike=True)
    with pytest.raises(CaseFailure, match="disagree on NaN"):
        close(swapped, ref64, torch.float32, "scales")  # other ops keep NaN and infinities apart
    for bad_at, value in ((2, 1.0), (5, float("nan")), (5, float("inf"))):
        wrong = ref64.clone()
        wrong[bad_at] = value
        with pytest.raises(CaseFailure, match="finite"):
            close(wrong, ref64, torch.float32, "exp_avg", non_finite_alike=True)
