"""The cuda plugin's Triton newton_schulz iterates a tall batch as its transposed view in its own (row-major tall,
so column-major wide) memory layout, under the interpreter: the kernels get the column-major strides (no
transposing copy in), the result comes back row-major tall with no copy out. In bf16 it equals, bit for bit, the
iteration of the transposed batch made contiguous first (the layout the op was given before ZeRO's Muon handed it
tall blocks as they lie); in fp16 the fp32 norm is summed in the layout's order, so the scale may round apart.
Both within the 16-bit bounds of the float64 reference. With ``out`` the last step's launch writes it."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import newton_schulz as kn
from polyaccel.testing.conformance import opcases_muon as om
from torch.utils._python_dispatch import TorchDispatchMode

CFG = kn.TileConfig(16, 16, 16, 1, 1, group_m=2)
KW = {"steps": 2, "coefficients": ref.muon.NS_COEFFICIENTS, "eps": 1e-7, "config": CFG}


class Copies(TorchDispatchMode):
    """The elements written by copies (``copy_``, ``clone``, casts) inside the block, outside the kernel launches
    (the interpreter copies a launch's tensors itself); the gram kernel's size and strides at every launch."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.elements = 0
        self.gram = []
        self.written = []  # the address each launch writes
        self._launching = False
        for name in ("_gram_kernel", "_poly_kernel", "_update_kernel"):
            monkeypatch.setattr(kn, name, self._launcher(getattr(kn, name), name == "_gram_kernel"))

    def _launcher(self, real, record: bool):
        mode = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    if record:
                        mode.gram.append(tuple(args[2:7]))  # M, K and X's strides
                    mode.written.append(args[2 if len(args) > 12 else 1].data_ptr())  # Y / A / B
                    mode._launching = True
                    try:
                        return real[grid](*args, **kw)
                    finally:
                        mode._launching = False
                return launch
        return Launcher()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._launching and func.overloadpacket.__name__ in ("copy_", "clone", "_to_copy", "copy"):
            self.elements += out.numel()
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_tall_batch_is_iterated_in_its_own_layout(dtype, monkeypatch):
    torch.manual_seed(2)
    tall = torch.randn(3, 40, 24).to(dtype)
    copies = Copies(monkeypatch)
    with copies:
        got = kn.newton_schulz(tall, **KW)
    # wide 24 x 40 blocks read column-major from the tall batch's own layout, once a step
    assert copies.gram == [(24, 40, 40 * 24, 1, 24)] * KW["steps"], copies.gram
    assert got.shape == tall.shape and got.dtype == dtype and got.is_contiguous()
    # the fp16 scaling in fp32 casts (in and out of fp32, in the batch's layout); no transposing copy else
    assert copies.elements == (2 * tall.numel() if dtype == torch.float16 else 0), copies.elements
    copies.gram.clear()
    before = kn.newton_schulz(tall.mT.contiguous(), **KW)
    assert copies.gram[0][3:] == (40, 1), copies.gram  # the contiguous wide batch: row-major strides
    if dtype == torch.bfloat16:
        assert torch.equal(got, before.mT)
    else:  # the norm, summed in fp32 in another order (the layout's), may round to another fp16 scale
        assert om.relative_errors(got, before.mT).max().item() <= 1e-2
    exact = ref.newton_schulz(tall.double(), steps=KW["steps"])
    assert om.relative_errors(got, exact).max().item() <= om.NS_BOUNDS[dtype]


@pytest.mark.parametrize("steps", [5, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_is_written_by_the_last_step(dtype, steps, monkeypatch):
    """With ``out`` (here a tall batch's row-major out, and x itself), the iteration alternates between out and
    one scratch batch so that its last launch writes out: no copy after it, the values of the call without it."""
    torch.manual_seed(3)
    tall = torch.randn(2, 40, 24).to(dtype)
    kw = {**KW, "steps": steps}
    alone = kn.newton_schulz(tall, **kw)
    for name in ("a new out", "out=x"):
        out = torch.empty_like(tall) if name == "a new out" else tall.clone()
        x = tall if name == "a new out" else out
        copies = Copies(monkeypatch)
        with copies:
            got = kn.newton_schulz(x, **kw, out=out)
        assert got is out and torch.equal(out, alone), name
        assert copies.written[-1] == out.data_ptr(), name  # the last update launch wrote out
        # the fp16 scaling's casts into fp32 and (into the scratch batch: odd steps) back are the only copies
        fp16 = tall.numel() * (1 + steps % 2)
        assert copies.elements == (fp16 if dtype == torch.float16 else 0), (name, copies.elements)
