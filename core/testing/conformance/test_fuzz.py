"""The op-contract fuzz rows: collected only with ``--polyaccel-fuzz`` (``polyaccel conformance --fuzz``).

One row per (op, builder) serving the accelerator's device type, the reference included:
hypothesis draws the cases (:mod:`polyaccel.testing.conformance.fuzz`), the row FAILs with
the builder's name and the minimal failing case, or PASSes noting how the cases ended.
"""

from __future__ import annotations

import pytest
from polyaccel.testing.conformance import fuzz


def pytest_generate_tests(metafunc):
    if "fuzz_target" not in metafunc.fixturenames:
        return
    from polyaccel.testing.conformance.plugin import get_target

    params = []
    for t in fuzz.fuzz_targets(get_target(metafunc.config)):
        variant = f"{t.builder} ({t.plugin}{', chosen' if t.chosen else ''})"
        marks = [pytest.mark.conformance(area="op", subject=t.op, check="fuzz", variant=variant)]
        if t.skip:
            marks.append(pytest.mark.skip(reason=t.skip))
        params.append(pytest.param(t, id=f"{t.op}-{t.builder}", marks=marks))
    metafunc.parametrize("fuzz_target", params)


def test_fuzz(conformance_target, conformance_row, fuzz_target, request):
    from polyaccel.testing.conformance.plugin import fuzz_budget

    examples, seed = fuzz_budget(request.config)
    acc = conformance_target.accelerator
    stats = fuzz.check_builder(fuzz_target.op, fuzz_target.builder, device=acc.device(),
                               dtypes=fuzz.fuzz_dtypes(fuzz_target.op, acc.supported_dtypes()), fp8=acc.has("fp8"),
                               examples=examples, seed=seed, plugin=fuzz_target.plugin)
    acc.synchronize()
    conformance_row.note(str(stats))
