"""Errors of the communication layer, and the translation of c10d's raw failures into them."""

from __future__ import annotations

from ..errors import PolyaccelError
from .peers import describe_lost

TIMEOUT_ENV = "POLYACCEL_COMM_TIMEOUT"


class CommError(PolyaccelError):
    """A collective or p2p call failed (a ``RuntimeError``, like the torch error it replaces)."""

    def __init__(self, message: str, *, op: str = ""):
        super().__init__(message)
        self.op = op


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not take part in a call within the process group's timeout."""


class PeerLostError(CommError, ConnectionError):
    """A peer process closed its connection mid-call (it exited, crashed or timed out itself)."""


class CommArgumentError(PolyaccelError, ValueError):
    """A collective was called with arguments that cannot work (sizes, splits, dtypes)."""


# Fragments of gloo/nccl/c10d messages; matched case-insensitively.
_TIMEOUT_MARKS = ("timed out", "timeout")
_PEER_LOST_MARKS = ("connection closed by peer", "connection reset", "pair closure", "broken pipe",
                    "socket closed", "read error", "connection refused", "end of file")


def translate(op: str, exc: BaseException, timeout_s: float | None = None) -> BaseException:
    """Turn a raw torch/c10d failure of ``op`` into a :class:`CommError` with the likely cause and fix.

    Our own errors and non-runtime errors (bad arguments raised by torch as ValueError/TypeError)
    are returned unchanged.
    """
    if isinstance(exc, PolyaccelError) or not isinstance(exc, RuntimeError):
        return exc
    raw = str(exc).strip()
    low = raw.lower()
    if any(m in low for m in _PEER_LOST_MARKS):
        lost = describe_lost()
        return PeerLostError(
            f"polyaccel.comm.{op}: a peer closed its connection before the call completed "
            f"(a rank exited, crashed, or gave up after its own timeout){': ' + lost if lost else ''}. "
            f"torch said: {raw}",
            op=op,
        )
    if any(m in low for m in _TIMEOUT_MARKS):
        limit = f"{timeout_s:g} s" if timeout_s is not None else "the process group timeout"
        return CommTimeoutError(
            f"polyaccel.comm.{op}: timed out after {limit} waiting for a peer that never took part "
            f"(check that every rank issues the same calls in the same order, with matching src/dst and tags). "
            f"Raise the limit with init_distributed(timeout=...) or {TIMEOUT_ENV}=<seconds>. torch said: {raw}",
            op=op,
        )
    return CommError(f"polyaccel.comm.{op} failed: {raw}", op=op)
