"""How the op fuzz suite judges one call: an honest refusal, or numbers equal to the reference.

A call passes when it returns what the reference computes (on float64 copies) within the
dtype's tolerance, NaN where the reference has NaN and the same infinities, without touching
what it only reads or anything outside the tensors it writes; or when it raises
:class:`polyaccel.errors.OpArgumentError` leaving every input bitwise unchanged. Anything
else raises :class:`CaseFailure` saying what went wrong.
"""

from __future__ import annotations

import torch
from polyaccel.errors import OpArgumentError

from .fuzz_layouts import Buffers
from .opcases import op_tolerances

COMPARED = "compared"
REFUSED = "refused"


class CaseFailure(AssertionError):
    """One drawn case broke the op's contract; the message says how."""


def pretty_repr(self, p, cycle):
    """A case's ``_repr_pretty_``: hypothesis prints a falsifying example through it, as the case's repr."""
    p.text(repr(self))


def fail(problem: str):
    raise CaseFailure(problem)


def _one_line(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def attempt(call, buffers: Buffers, must_refuse: str = ""):
    """Run ``call`` after snapshotting ``buffers``; returns ``(COMPARED, result)`` or ``(REFUSED, None)``.

    ``must_refuse`` names what the contract says the op must refuse in this case ("" when the
    case is valid): then returning normally fails.
    """
    buffers.snapshot()
    try:
        result = call()
    except OpArgumentError as exc:
        changed = buffers.changed()
        if changed:
            fail(f"raised OpArgumentError ({_one_line(exc)}) but modified {', '.join(changed)} first "
                 "(a refusal must leave every input unchanged)")
        buffers.refusal = _one_line(exc, 80)
        return REFUSED, None
    except Exception as exc:  # noqa: BLE001 - every other exception is the finding
        fail(f"raised {type(exc).__name__}: {_one_line(exc)} (only polyaccel.errors.OpArgumentError is an "
             "honest refusal)")
    if must_refuse:
        fail(f"accepted {must_refuse}; the contract says it raises OpArgumentError")
    gaps = buffers.gaps_changed()
    if gaps:
        fail(f"wrote outside the elements of {', '.join(gaps)} (into the rest of its storage)")
    return COMPARED, result


def unchanged(buffers: Buffers, roles: set[str]) -> None:
    changed = buffers.changed(roles)
    if changed:
        fail(f"modified {', '.join(changed)}, which the op only reads")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, *,
          mag: torch.Tensor | None = None, atol_scale: float = 1.0, non_finite_alike: bool = False) -> None:
    """``actual`` matches the float64 ``expected``: NaN for NaN, equal infinities, else within tolerance.

    ``non_finite_alike`` (the optimizer ops' contract): where ``expected`` is NaN or infinite, ``actual``
    must be NaN or infinite too, but which one is not compared; a finite value there fails, and so
    does a non-finite value where ``expected`` is finite.

    The bound is ``atol * atol_scale + rtol * |expected|`` for ``dtype`` (float64 results get
    float32 bounds: ops compute in at least fp32); ``mag`` replaces ``|expected|`` where a sum
    can cancel (the same op on absolute values bounds a dot product's rounding error).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        fail(f"{what}: shape {tuple(actual.shape)}, the reference's is {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    if not a.numel():
        return
    if non_finite_alike:
        fin_a, fin_e = a.isfinite(), e.isfinite()
        if not torch.equal(fin_a, fin_e):
            i = int((fin_a != fin_e).nonzero()[0])
            fail(f"{what}: flat element {i} is {a[i].item()!r} where the reference has {e[i].item()!r} "
                 f"({int((fin_a != fin_e).sum())} of {a.numel()} elements disagree on being finite)")
        a, e = torch.where(fin_e, a, 0.0), torch.where(fin_e, e, 0.0)
    nan_a, nan_e = a.isnan(), e.isnan()
    if not torch.equal(nan_a, nan_e):
        i = int((nan_a != nan_e).nonzero()[0])
        fail(f"{what}: flat element {i} is {a[i].item()!r} where the reference has {e[i].item()!r} "
             f"({int((nan_a != nan_e).sum())} of {a.numel()} elements disagree on NaN)")
    inf_e = e.isinf()
    if bool((a[inf_e] != e[inf_e]).any()):
        i = int((inf_e & (a != e)).nonzero()[0])
        fail(f"{what}: flat element {i} is {a[i].item()!r} where the reference has {e[i].item()!r}")
    fin = ~(nan_e | inf_e)
    rtol, atol = op_tolerances(dtype)
    size = (mag.detach().to("cpu", torch.float64).reshape(-1) if mag is not None else e.abs())
    err = (a - e).abs()
    bad = fin & ~(err <= atol * atol_scale + rtol * size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        fail(f"{what}: {int(bad.sum())} of {a.numel()} elements out of tolerance (rtol={rtol:g}, "
             f"atol={atol * atol_scale:g}); first at flat {i}: got {a[i].item()!r}, reference {e[i].item()!r}")
