"""Conformance cases of Muon's element-wise passes (``muon_momentum``, ``muon_apply``) against the float64 reference.

Each case lays pieces of ragged lengths (zero-size included) at shuffled, non-adjacent offsets of three (two) flat
buffers with elements left between and around them, runs the builder on device copies of fresh random values and
the reference on float64 host copies, and compares the pieces within the dtype's tolerance (the apply pass against
the size of its two terms, which may cancel). Everything outside the pieces, and the gradient or the updates, must
come back bitwise unchanged.
"""

from __future__ import annotations

import random

import torch
from polyaccel.ops import reference as ref

from .opcases import _close, _dev, op_tolerances

#: piece lengths: ragged, one empty, one longer than the kernels' chunks
PIECE_LENGTHS = [7, 0, 33, 1, 130, 1031, 16]
MOMENTUM_ARGS = [dict(momentum=0.95, nesterov=True), dict(momentum=0.9, nesterov=False),
                 dict(momentum=0.3, nesterov=True)]  # 0.3: lerp's other branch for both weights
APPLY_ARGS = [dict(lr=0.02, wd=(0.1, 0.0), scale=(1.0, 2.5)), dict(lr=0.5, wd=(0.0, 0.0), scale=(0.2, 0.7))]


def layout(lengths, rng: random.Random, gap: int = 3) -> tuple[list[int], int]:
    """(offsets, size): the pieces in a shuffled order, ``gap`` elements between and around them."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    offsets, at = [0] * len(lengths), gap
    for i in order:
        offsets[i] = at
        at += lengths[i] + gap
    return offsets, at


def _outside(size: int, offsets, lengths) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool)
    for o, n in zip(offsets, lengths, strict=True):
        mask[o:o + n] = False
    return mask


def _pieces(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return torch.cat([t[o:o + n] for o, n in zip(offsets, lengths, strict=True)])


def _out_dtypes(dtype):
    return [torch.float64, torch.bfloat16] if dtype == torch.float64 else sorted(
        {torch.float32, torch.bfloat16, dtype}, key=str)


def check_muon_momentum(fn, device: torch.device, dtype: torch.dtype) -> None:
    """``dtype``: the gradient's (the buffer is float64 for a float64 gradient, float32 otherwise)."""
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    lengths = PIECE_LENGTHS
    buf_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for out_dtype in _out_dtypes(dtype):
        for args in MOMENTUM_ARGS:
            (go, gs), (bo, bs), (oo, os_) = (layout(lengths, rng) for _ in range(3))
            grad = torch.randn(gs).to(dtype)
            buf = (torch.randn(bs) * 0.1).to(buf_dtype)
            out = torch.randn(os_).to(out_dtype)
            g_dev, b_dev, o_dev = _dev(grad, device), _dev(buf, device), _dev(out, device)
            where = f"muon_momentum grad {dtype}, out {out_dtype}, {args}"
            fn(g_dev, b_dev, o_dev, grad_offsets=go, buffer_offsets=bo, out_offsets=oo, lengths=lengths, **args)
            b64, o64 = buf.double(), out.double()
            ref.muon_momentum(grad.double(), b64, o64, grad_offsets=go, buffer_offsets=bo, out_offsets=oo,
                              lengths=lengths, **args)
            got_b, got_o = b_dev.cpu(), o_dev.cpu()
            assert torch.equal(g_dev.cpu(), grad), f"{where}: the gradient was modified"
            for name, got, before, offs, size in (("momentum_buffer", got_b, buf, bo, bs),
                                                  ("out", got_o, out, oo, os_)):
                keep = _outside(size, offs, lengths)
                assert torch.equal(got[keep], before[keep]), f"{where}: {name} changed outside its pieces"
            _close(_pieces(got_b, bo, lengths), _pieces(b64, bo, lengths), buf_dtype, f"{where}: momentum")
            _close(_pieces(got_o, oo, lengths), _pieces(o64, oo, lengths), out_dtype, f"{where}: update")


def check_muon_apply(fn, device: torch.device, dtype: torch.dtype) -> None:
    """``dtype``: the params' (updates in that dtype and in bfloat16)."""
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    lengths = PIECE_LENGTHS
    for upd_dtype in sorted({dtype, torch.bfloat16}, key=str):
        for args in APPLY_ARGS:
            (po, ps), (uo, us) = layout(lengths, rng), layout(lengths, rng)
            wds = [args["wd"][i % 2] for i in range(len(lengths))]
            scales = [args["scale"][(i // 2) % 2] for i in range(len(lengths))]
            params = torch.randn(ps).to(dtype)
            upd = torch.randn(us).to(upd_dtype)
            p_dev, u_dev = _dev(params, device), _dev(upd, device)
            where = f"muon_apply params {dtype}, updates {upd_dtype}, {args}"
            kw = dict(param_offsets=po, update_offsets=uo, lengths=lengths, lr=args["lr"], weight_decays=wds,
                      lr_scales=scales)
            fn(p_dev, u_dev, **kw)
            p64 = params.double()
            ref.muon_apply(p64, upd.double(), **kw)
            got = p_dev.cpu()
            assert torch.equal(u_dev.cpu(), upd), f"{where}: the updates were modified"
            keep = _outside(ps, po, lengths)
            assert torch.equal(got[keep], params[keep]), f"{where}: params changed outside their pieces"
            # the two terms' sizes bound the rounding (the sum may cancel)
            decay = torch.cat([params[o:o + n].double() * (1 - args["lr"] * wd)
                               for o, n, wd in zip(po, lengths, wds, strict=True)])
            step = torch.cat([upd[o:o + n].double() * args["lr"] * s
                              for o, n, s in zip(uo, lengths, scales, strict=True)])
            rtol, atol = op_tolerances(dtype)
            err = (_pieces(got, po, lengths).double() - _pieces(p64, po, lengths)).abs()
            bound = atol + rtol * (decay.abs() + step.abs())
            assert bool((err <= bound).all()), (
                f"{where}: a parameter is {float((err - bound).max()):.3e} beyond the bound "
                f"(max error {float(err.max()):.3e})")


CHECKS = {"muon_momentum": check_muon_momentum, "muon_apply": check_muon_apply}

__all__ = ["CHECKS", "check_muon_apply", "check_muon_momentum", "layout"]
