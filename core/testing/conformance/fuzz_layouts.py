"""Tensor layouts the op fuzz suite draws, and the tensors made from them.

A :class:`Layout` is pure data (shape, strides, storage offset, size of the buffer), so a
failing example prints as something a person can rebuild by hand. Every tensor lives in a
buffer of its own that is larger than the view: the gaps hold random values, so a builder
that reads the buffer as if it were the tensor (ignoring strides or the offset) computes
wrong numbers, and one that writes there is caught by :meth:`Buffers.gaps_changed`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Layout:
    """A view ``buffer.as_strided(shape, strides, offset)`` of a 1-D buffer of ``storage`` elements."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    storage: int = 0

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], offset: int = 0) -> Layout:
        strides, running = [], 1
        for n in reversed(shape):
            strides.append(running)
            running *= max(n, 1)
        return cls(tuple(shape), tuple(reversed(strides)), offset, offset + math.prod(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def overlapping(self) -> bool:
        """Some element of the view is reached through two indices (a stride-0 expand)."""
        return self.numel > 1 and any(s == 0 and n > 1 for n, s in zip(self.shape, self.strides, strict=True))

    def __repr__(self) -> str:
        return f"shape {self.shape} strides {self.strides} offset {self.offset}"


_SIDES = st.lists(st.integers(0, 7), min_size=0, max_size=3)
_SIDES_2D = st.lists(st.integers(0, 7), min_size=2, max_size=2)
_STEPS = st.sampled_from((1, 2, 3))
_OFFSETS = st.integers(0, 5)
_SLACK = st.integers(0, 3)
_ORDERS = {nd: st.permutations(range(nd)) for nd in range(2, 5)}
_INDICES = st.integers(0, 2**16)
_PLANTED = st.integers(0, 2)


def draw_shape(draw, two_dims: bool = False) -> tuple[int, ...]:
    """Up to three sides of 0-7 (zero-size and odd sides, and 0-d); exactly two with ``two_dims``."""
    return tuple(draw(_SIDES_2D if two_dims else _SIDES))


def draw_layout(draw, shape: tuple[int, ...], *, strided: bool = True, overlap: bool = False) -> Layout:
    """A non-overlapping layout of ``shape``: dims in any memory order, each stepped by 1-3, at an offset.

    Shrinks towards the plain contiguous layout, so a minimal failing example keeps only the
    non-contiguity it needs. ``strided=False`` keeps it contiguous (only the offset varies);
    ``overlap`` makes one dim of size > 1 a stride-0 expand instead.
    """
    nd = len(shape)
    if not strided:
        lay = Layout.contiguous(shape, draw(_OFFSETS))
        return dataclasses.replace(lay, storage=lay.storage + draw(_SLACK))
    order = list(draw(_ORDERS[nd])) if nd > 1 else list(range(nd))
    steps = [draw(_STEPS) for _ in range(nd)]
    offset = draw(_OFFSETS)
    strides, running = [0] * nd, 1
    for d in reversed(order):
        strides[d] = running * steps[d]
        running = strides[d] * max(shape[d], 1)
    if overlap:
        wide = [d for d in range(nd) if shape[d] > 1]
        if wide:
            strides[wide[draw(st.integers(0, len(wide) - 1))]] = 0
    return Layout(tuple(shape), tuple(strides), offset, offset + running + draw(_SLACK))


#: what the fuzz suite plants among finite values
SPECIAL_VALUES = (math.nan, math.inf, -math.inf)
_SPECIALS = {values: st.sampled_from(values) for values in (SPECIAL_VALUES, (math.nan,))}


def draw_specials(draw, numel: int, values=SPECIAL_VALUES, max_count: int = 2) -> tuple[tuple[int, float], ...]:
    """Up to ``max_count`` (flat index, value) pairs of NaN/Inf to plant in a tensor of ``numel`` elements."""
    if numel == 0:
        return ()
    count = min(draw(_PLANTED), max_count)
    return tuple((draw(_INDICES) % numel, draw(_SPECIALS[values])) for _ in range(count))


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor of a drawn case: its role, layout, dtype and the NaN/Inf planted in it."""

    role: str
    layout: Layout
    dtype: torch.dtype
    planted: tuple[tuple[int, float], ...] = ()

    def __repr__(self) -> str:
        text = f"{self.role}: {dtype_name(self.dtype)} {self.layout!r}"
        if self.planted:
            text += " with " + ", ".join(f"{v} at flat {i}" for i, v in self.planted)
        return text


@dataclass
class Buffers:
    """The buffers of one trial's tensors, with snapshots to tell what a call changed."""

    device: torch.device
    generator: torch.Generator
    entries: list[tuple[str, torch.Tensor, Layout]] = field(default_factory=list)
    _before: list[torch.Tensor] = field(default_factory=list)
    #: the message of the OpArgumentError the call refused with, if it did
    refusal: str = ""

    def make(self, spec: TensorSpec, *, scale: float = 1.0, positive: bool = False,
             values: torch.Tensor | None = None) -> torch.Tensor:
        """The view ``spec`` describes, in a fresh buffer of random values; ``values`` (host) if given."""
        lay = spec.layout
        raw = torch.randn(lay.storage, generator=self.generator, dtype=torch.float64) * scale
        buf = (raw.abs() if positive else raw).to(spec.dtype).to(self.device)
        view = buf.as_strided(lay.shape, lay.strides, lay.offset)
        if not lay.overlapping:  # an expanded view keeps the buffer's values (it cannot be written whole)
            if values is None:
                vals = torch.randn(lay.shape, generator=self.generator, dtype=torch.float64) * scale
                vals = vals.abs() if positive else vals
            else:
                vals = values.to(torch.float64, copy=True)
            flat = vals.view(-1)
            for i, v in spec.planted:
                flat[i % max(flat.numel(), 1)] = v
            view.copy_(vals.to(spec.dtype))
        self.entries.append((spec.role, buf, lay))
        return view

    def snapshot(self) -> None:
        self._before = [buf.detach().to("cpu", copy=True) for _, buf, _ in self.entries]

    def changed(self, roles: set[str] | None = None) -> list[str]:
        """Roles whose buffer differs bitwise from the snapshot (all roles, or those in ``roles``)."""
        out = []
        for (role, buf, _), before in zip(self.entries, self._before, strict=True):
            if roles is not None and role not in roles:
                continue
            if not _bitwise_equal(buf.detach().cpu(), before):
                out.append(role)
        return out

    def gaps_changed(self) -> list[str]:
        """Roles whose buffer changed outside the elements of its view (a write past the tensor)."""
        out = []
        for (role, buf, lay), before in zip(self.entries, self._before, strict=True):
            inside = torch.zeros(lay.storage, dtype=torch.bool)
            if lay.numel:
                inside[torch.arange(lay.storage).as_strided(lay.shape, lay.strides, lay.offset).reshape(-1)] = True
            now = buf.detach().cpu()
            if not _bitwise_equal(now[~inside], before[~inside]):
                out.append(role)
        return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return b.numel() == 0
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def host64(t: torch.Tensor) -> torch.Tensor:
    """A contiguous float64 host copy (never aliasing ``t``)."""
    return t.detach().to("cpu", torch.float64, copy=True).contiguous()
