"""polyaccel.ops.offsets: offsets valid by construction are not read back; any other offsets (checked before or
not, changed in place or behind the version counter, other rows) are read and checked, so bad values are refused."""

from __future__ import annotations

import importlib

import pytest
import torch
from polyaccel.errors import InvalidArgument, OpArgumentError
from polyaccel.ops import offsets as known_offsets

reference_grouped_mm = importlib.import_module("polyaccel.ops.reference.grouped_mm")


@pytest.fixture
def reads(monkeypatch):
    real = reference_grouped_mm._checked_on_host
    calls = []
    monkeypatch.setattr(reference_grouped_mm, "_checked_on_host",
                        lambda off, rows: calls.append(off.tolist()) or real(off, rows))
    return calls


def _product(x, w, offsets):
    want = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        want[start:end] = x[start:end].double() @ w[e].double()
        start = end
    return want


def test_marked_offsets_are_not_read_and_the_product_is_right(reads):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 5, generator=gen), torch.randn(3, 5, 4, generator=gen)
    ends = known_offsets.mark_complete(torch.tensor([2, 2, 9]), 9)
    out = reference_grouped_mm.grouped_mm(x, w, ends)
    assert reads == []
    torch.testing.assert_close(out.double(), _product(x, w, ends), rtol=1e-5, atol=1e-5)


def test_a_changed_tensor_is_read_and_checked_again(reads):
    x, w = torch.randn(9, 5), torch.randn(3, 5, 4)
    ends = known_offsets.mark_complete(torch.tensor([2, 2, 9]), 9)
    ends[1] = 1  # in place: the mark no longer holds
    with pytest.raises(OpArgumentError, match="non-decreasing"):
        reference_grouped_mm.grouped_mm(x, w, ends)
    assert reads == [[2, 1, 9]]


def test_other_rows_or_another_tensor_are_read(reads):
    ends = known_offsets.mark_complete(torch.tensor([3, 9]), 9)
    assert reference_grouped_mm.last_offset(ends, 12) == 9  # marked for 9 rows, asked for 12: read
    with pytest.raises(OpArgumentError, match="exceeds the 8 rows"):
        reference_grouped_mm.last_offset(ends, 8)
    assert reference_grouped_mm.last_offset(torch.tensor([3, 9]), 9) == 9  # equal values, another tensor: read
    assert len(reads) == 3


def test_checked_offsets_are_read_again_at_every_call(reads):
    ends = torch.tensor([4, 6])
    assert reference_grouped_mm.last_offset(ends, 7) == 6
    assert reference_grouped_mm.last_offset(ends, 7) == 6
    assert known_offsets.known_last(ends, 7) is None
    assert reads == [[4, 6], [4, 6]]


@pytest.mark.parametrize("alias", ["numpy", "data", "set_"])
def test_offsets_refilled_behind_the_version_counter_are_refused(alias):
    """A write through a NumPy view, a ``.data`` alias or a tensor set_ to the same storage does not bump the
    offsets' version counter: a check made before it must not be trusted after it."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 5, generator=gen), torch.randn(2, 5, 4, generator=gen)
    ends = torch.tensor([2, 6])
    torch.testing.assert_close(reference_grouped_mm.grouped_mm(x, w, ends).double(), _product(x, w, ends),
                               rtol=1e-5, atol=1e-5)
    version = ends._version
    if alias == "numpy":
        ends.numpy()[:] = [5, 2]
    elif alias == "data":
        ends.data.copy_(torch.tensor([5, 2]))
    else:
        torch.empty(0, dtype=ends.dtype).set_(ends.untyped_storage()).copy_(torch.tensor([5, 2]))
    assert ends.tolist() == [5, 2] and ends._version == version  # the counter did not see it
    with pytest.raises(OpArgumentError, match="non-decreasing"):
        reference_grouped_mm.grouped_mm(x, w, ends)


def test_mark_complete_refuses_what_cannot_be_offsets():
    with pytest.raises(InvalidArgument, match="non-empty 1-D"):
        known_offsets.mark_complete(torch.tensor([[1, 2]]), 2)
    with pytest.raises(InvalidArgument, match="non-empty 1-D"):
        known_offsets.mark_complete(torch.tensor([], dtype=torch.int64), 0)
    with pytest.raises(InvalidArgument, match="int32 or int64"):
        known_offsets.mark_complete(torch.tensor([1.0, 2.0]), 2)
