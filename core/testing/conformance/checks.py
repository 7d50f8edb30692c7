"""Assertions the conformance tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from polyaccel.errors import Unsupported

#: capabilities with a check in test_capabilities.py (async_p2p: in test_comm.py)
CHECKED_CAPABILITIES = frozenset({"streams", "events", "graphs", "host_register", "pinned", "memory_stats", "rng",
                                  "fp64", "bf16", "fp16", "fp8", "triton", "async_p2p"})


def expect_unsupported(acc, call: Callable[[], Any], what: str, capability: str) -> str:
    """``call()`` must raise :class:`polyaccel.Unsupported` naming ``acc``'s plugin; return its message.

    Returning normally is the failure this suite exists to catch: a silent no-op for a
    capability the plugin does not claim.
    """
    try:
        result = call()
    except Unsupported as exc:
        if exc.plugin != acc.name:
            pytest.fail(f"{what} raised Unsupported naming plugin {exc.plugin!r}, expected {acc.name!r}")
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any other exception is the wrong answer
        pytest.fail(f"{capability!r} is not claimed, so {what} must raise polyaccel.Unsupported; "
                    f"it raised {type(exc).__name__}: {exc}")
    pytest.fail(f"{capability!r} is not claimed, yet {what} returned {_short(result)} instead of raising "
                f"polyaccel.Unsupported (a silent no-op)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def claim(conformance_target, conformance_row, capability: str) -> bool:
    claimed = conformance_target.claims(capability)
    conformance_row.claimed(claimed)
    return claimed
