"""``polyaccel.ops.newton_schulz(x, out=...)``: the result written into ``out`` (a new tensor of either layout, a
slice of a buffer beside ``x``, or ``x`` itself) equals the float64 iteration within the dtype's bound and the call
without ``out``; a bad ``out`` is refused naming it, before anything is written."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.errors import OpArgumentError
from polyaccel.ops import reference as ref
from polyaccel.testing.conformance import opcases_muon as om


def _x(shape=(3, 6, 10), dtype=torch.float32):
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_out_beside_x_in_one_buffer_and_over_x(dtype):
    torch.manual_seed(0)
    buf = torch.randn(2, 3, 10, 6).to(dtype)  # x (tall) and out side by side in one buffer
    x, out = buf[0], buf[1]
    want = ref.newton_schulz(x.double())
    alone = ops.newton_schulz(x)
    assert ops.newton_schulz(x, out=out) is out
    assert torch.equal(out, alone) and torch.equal(buf[0], x)
    assert om.relative_errors(out, want).max().item() <= om.NS_BOUNDS[dtype]
    assert ops.newton_schulz(x, out=x) is x  # over x itself
    assert torch.equal(x, alone)


def test_bad_out_is_refused_naming_it_and_nothing_is_written():
    torch.manual_seed(1)
    x = _x()
    buf = torch.randn(2, 3, 6, 10)
    cases = {
        "a list": ([0.0],),
        "another shape": (torch.randn(3, 10, 6),),
        "another dtype": (torch.randn(3, 6, 10, dtype=torch.float64),),
        "expanded": (torch.randn(1, 6, 10).expand(3, 6, 10),),
    }
    for name, (out,) in cases.items():
        before = out.clone() if isinstance(out, torch.Tensor) else None
        with pytest.raises(OpArgumentError, match="newton_schulz: out"):
            ops.newton_schulz(x, out=out)
        if before is not None:
            assert torch.equal(out, before), name
    # out overlapping x without being x: one matrix further on in the same buffer, and x transposed in place
    flat = buf.view(-1)
    a, b = flat[:180].view(3, 6, 10), flat[60:240].view(3, 6, 10)
    saved = buf.clone()
    with pytest.raises(OpArgumentError, match="shares memory with x"):
        ops.newton_schulz(a, out=b)
    sq = torch.randn(2, 7, 7)
    with pytest.raises(OpArgumentError, match="shares memory with x"):
        ops.newton_schulz(sq, out=sq.mT)
    assert torch.equal(buf, saved)
