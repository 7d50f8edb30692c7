"""The per-backend conformance suite: certify one accelerator plugin against the contract.

Run it with ``polyaccel conformance --accelerator NAME`` (a table, ``--json``, ``--junitxml``),
from Python with :func:`run_suite`, or with plain pytest::

    pytest -p polyaccel.testing.conformance.plugin --pyargs polyaccel.testing.conformance \\
        --polyaccel-accelerator NAME

What it checks (one row each; see ``docs/plugin-authoring.md``):

* device basics: identity, probe, devices, synchronize, copies, dtype claims;
* every capability in ``polyaccel.accelerator.KNOWN_CAPABILITIES`` plus any the plugin
  claims: claimed ones must work, unclaimed ones must raise ``polyaccel.Unsupported``;
* every op on the accelerator's device type vs the core reference, per claimed dtype;
* collectives and p2p over two ranks when the communication backend can run here.

This package imports nothing heavy on import; the test modules are collected by pytest.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("run_suite", "SuiteRun", "PYTEST_PLUGIN", "SUITE_PACKAGE"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PYTEST_PLUGIN", "SUITE_PACKAGE", "SuiteRun", "run_suite"]
