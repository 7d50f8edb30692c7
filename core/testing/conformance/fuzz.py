"""The op-contract fuzz suite: every builder of every op, on drawn inputs, against the reference.

``polyaccel conformance --fuzz`` runs it for the selected accelerator's device type (one row
per op and builder, reference included); :func:`check_builder` runs it for one builder from
Python. For each op, hypothesis draws cases (:mod:`.fuzz_ops`): shapes with zero-size and odd
sides, non-contiguous layouts (dims in any memory order, stepped, at storage offsets, each
tensor its own), every dtype the accelerator supports, NaN and ±Inf in optimizer gradients and
quantizer inputs, bad hyperparameters and overlapping written tensors. Each case is run through
``polyaccel.ops.<op>`` with the builder forced by ``polyaccel.ops.override``, and judged by
:mod:`.fuzz_outcome`: equal to the reference (float64 host copies), or an honest refusal
(``OpArgumentError``, inputs unchanged). The first failing case is shrunk by hypothesis to a
minimal one, and the failure names the builder and prints that case (shapes, strides, offsets,
dtypes, seed of the values).

The run is reproducible: without a seed, hypothesis derandomizes (the same cases every run, as
CI needs); ``seed=`` draws another fixed set.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from .fuzz_ops import op_fuzzers
from .fuzz_outcome import CaseFailure
from .opcases import FLOATS

#: examples per (op, builder) when none is asked for: CI's fixed budget on the cpu plugin
DEFAULT_EXAMPLES = 25


class FuzzFailure(AssertionError):
    """A builder broke its op's contract on a drawn case; the message names it and the minimal case."""


@dataclass
class FuzzStats:
    """How the examples of one run ended: compared with the reference, or honestly refused."""

    compared: int = 0
    refused: int = 0
    #: refusal message (shortened) -> how many cases got it
    refusals: dict[str, int] = field(default_factory=dict)

    @property
    def examples(self) -> int:
        return self.compared + self.refused

    def __str__(self) -> str:
        text = (f"{self.examples} drawn cases: {self.compared} matched the reference, {self.refused} refused "
                "with OpArgumentError (inputs unchanged)")
        if self.refusals:
            top = sorted(self.refusals.items(), key=lambda kv: -kv[1])[:3]
            text += " [" + "; ".join(f"{n}x {msg}" for msg, n in top) + "]"
        return text


def fuzz_settings(examples: int = DEFAULT_EXAMPLES, seed: int | None = None) -> settings:
    """The hypothesis settings of a run: ``examples`` cases, no deadline, no example database.

    Without ``seed`` the cases are derandomized (fixed); with one they are drawn from it.
    """
    if not isinstance(examples, int) or examples < 1:
        raise ValueError(f"the fuzz example budget must be a positive int, got {examples!r}")
    return settings(max_examples=examples, deadline=None, derandomize=seed is None, database=None,
                    report_multiple_bugs=False, print_blob=False,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def fuzz_dtypes(op: str, accelerator_dtypes) -> tuple[torch.dtype, ...]:
    """The float dtypes the fuzz suite draws for ``op``: those the accelerator supports."""
    supported = set(accelerator_dtypes)
    return tuple(d for d in FLOATS if d in supported)


@contextlib.contextmanager
def overridden(op: str, builder: str):
    """``polyaccel.ops.override(op, builder)`` for the block; the previous override afterwards."""
    from polyaccel.ops import override, registry

    previous = registry._overrides.get(op)
    override(op, builder)
    try:
        yield
    finally:
        override(op, previous)


def check_builder(op: str, builder: str, *, device: torch.device | str, dtypes, fp8: bool = False,
                  examples: int = DEFAULT_EXAMPLES, seed: int | None = None, plugin: str = "") -> FuzzStats:
    """Fuzz ``builder`` of ``op`` on ``device``; raises :class:`FuzzFailure` on the first broken contract.

    ``dtypes`` are those to draw from (see :func:`fuzz_dtypes`); ``fp8`` adds fp8 quantizer
    modes. Returns how the drawn cases ended when every one passed.
    """
    fuzzers = op_fuzzers()
    if op not in fuzzers:
        raise ValueError(f"the fuzz suite has no strategy for op {op!r}; it knows {sorted(fuzzers)}")
    dtypes = tuple(dtypes)
    if not dtypes:
        raise ValueError(f"no dtype to fuzz {op!r} with")
    fuzz = fuzzers[op]
    device = torch.device(device)
    stats, refusals = Counter(), Counter()
    who = f"{op} builder {builder!r}" + (f" (plugin {plugin})" if plugin else "")

    def prop(case):
        try:
            outcome, _, why = fuzz.run(case, device).partition(": ")
            stats[outcome] += 1
            if why:
                refusals[why] += 1
        except CaseFailure as exc:
            raise FuzzFailure(f"{who} FAILS: {exc} | minimal reproducer: {case!r}") from None

    test = given(case=fuzz.strategy(dtypes, fp8))(fuzz_settings(examples, seed)(prop))
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    with overridden(op, builder):
        try:
            test()
        except FuzzFailure as exc:  # the shrunk case's failure, without hypothesis's notes (the message has it all)
            raise FuzzFailure(str(exc)) from None
    return FuzzStats(compared=stats["compared"], refused=stats["refused"], refusals=dict(refusals))


@dataclass(frozen=True)
class FuzzTarget:
    """One row of the fuzz suite: a builder of an op that serves the accelerator's device type."""

    op: str
    builder: str
    plugin: str
    chosen: bool
    skip: str = ""


def fuzz_targets(target) -> list[FuzzTarget]:
    """Every builder that serves ``target``'s device type, for every op (the reference included).

    A builder of the target's own plugin that is not compatible is listed with the reason (a
    SKIPPED row); other plugins' incompatible builders are not this accelerator's to serve.
    """
    from polyaccel.ops import registry

    known = op_fuzzers()
    out = []
    for op in registry.ops():
        if op not in known:
            out.append(FuzzTarget(op, "-", "-", False, skip=f"the fuzz suite has no strategy for op {op!r}"))
            continue
        for c in registry.candidates(op, target.device_type):
            b = c.builder
            if not b.serves(target.device_type):
                continue
            if c.reason.startswith("incompatible"):
                if b.plugin in target.plugin_names:
                    out.append(FuzzTarget(op, b.name, b.plugin, False, skip=f"builder {b.name!r} is {c.reason}"))
                continue
            out.append(FuzzTarget(op, b.name, b.plugin, c.chosen))
    return out


__all__ = ["DEFAULT_EXAMPLES", "FuzzFailure", "FuzzStats", "FuzzTarget", "check_builder", "fuzz_dtypes",
           "fuzz_settings", "fuzz_targets", "overridden"]
