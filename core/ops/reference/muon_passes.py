"""Reference of Muon's element-wise passes over pieces of flat buffers: the momentum (``muon_momentum``) and the
application of an orthogonalized update (``muon_apply``).

ZeRO keeps a partition's parameters, gradients and optimizer state in flat buffers; a Muon matrix's elements on
one rank are a *piece*: a run of consecutive elements at some offset of each buffer. These ops take the buffers
whole and a table of pieces (one offset per buffer and a length each), so a builder can serve all pieces of a
round in one pass. The reference is torch's multi-tensor ops over the pieces' views: the operations the engine
ran before the ops existed, in the same order, so it gives the same bits.
"""

from __future__ import annotations

import torch


def _views(t: torch.Tensor, offsets, lengths) -> list[torch.Tensor]:
    return [t[o:o + n] for o, n in zip(offsets, lengths, strict=True)]


def muon_momentum(grad, momentum_buffer, out, *, grad_offsets, buffer_offsets, out_offsets, lengths, momentum,
                  nesterov=True):
    """Muon's momentum and update over pieces of three flat tensors, in place. Returns None.

    `grad`, `momentum_buffer` and `out` are contiguous 1-D tensors on one device; `grad` is
    float64, float32, bfloat16 or float16 and only read, `momentum_buffer` float32 or float64
    (and float64 when `grad` is), `out` any floating dtype. Piece i is ``lengths[i]``
    consecutive elements from ``grad_offsets[i]`` of `grad`, ``buffer_offsets[i]`` of the
    buffer and ``out_offsets[i]`` of `out` (lists of ints, equally long; the buffer's pieces
    do not overlap, nor do `out`'s). Per piece, in the buffer's dtype (the gradient widened,
    exactly):

        buf = lerp(buf, g, 1 - momentum)                 # = momentum * buf + (1 - momentum) * g
        u = lerp(g, buf, momentum) if nesterov else buf
        out = u rounded once to out's dtype

    with torch's ``lerp`` (``torch.optim.Muon``'s momentum). `momentum` is in [0, 1); elements
    of `out` and of the buffer outside the pieces are left alone.
    """
    if not lengths:
        return
    wide = momentum_buffer.dtype
    bufs = _views(momentum_buffer, buffer_offsets, lengths)
    dsts = _views(out, out_offsets, lengths)
    grads = _views(grad, grad_offsets, lengths)
    widened = grad.dtype != wide
    if widened:  # the gradient widened (exactly) into one new buffer
        flat = torch.empty(sum(lengths), dtype=wide, device=grad.device)
        copies = list(flat.split(list(lengths)))
        torch._foreach_copy_(copies, grads)
        grads = copies
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    if not nesterov:
        torch._foreach_copy_(dsts, bufs)
    elif out.dtype == wide:
        torch._foreach_copy_(dsts, grads)
        torch._foreach_lerp_(dsts, bufs, momentum)  # = lerp(g, buf, momentum)
    else:  # lerp(g, buf, momentum) in the buffer's dtype, then rounded once into out (the gradient is only read)
        if widened:
            torch._foreach_lerp_(grads, bufs, momentum)
            update = grads
        else:
            update = torch._foreach_lerp(grads, bufs, momentum)
        torch._foreach_copy_(dsts, update)


def muon_apply(params, updates, *, param_offsets, update_offsets, lengths, lr, weight_decays, lr_scales):
    """Muon's decoupled weight decay and orthogonalized update over pieces of two flat tensors, in place.
    Returns None.

    `params` (written) and `updates` (only read) are contiguous 1-D floating tensors on one
    device, `updates` no wider than `params`. Piece i is ``lengths[i]`` consecutive elements
    from ``param_offsets[i]`` of `params` and ``update_offsets[i]`` of `updates` (lists of ints,
    equally long; the params' pieces do not overlap), with its own ``weight_decays[i]`` and
    ``lr_scales[i]``. Per piece:

        p = p * (1 - lr * weight_decays[i])              # rounded to params' dtype
        p = p + (-lr * lr_scales[i]) * O                 # O: the update widened to params' dtype

    in float32 for 16-bit params and in the params' dtype otherwise, the two factors computed in
    double precision and rounded to that dtype (as torch's multi-tensor ``mul_`` and ``add_``
    round a scalar). `lr`, every weight decay and scale are finite and >= 0.
    """
    groups: dict[tuple[float, float], tuple[list, list]] = {}
    for po, uo, n, wd, scale in zip(param_offsets, update_offsets, lengths, weight_decays, lr_scales, strict=True):
        ps, us = groups.setdefault((float(wd), float(scale)), ([], []))
        ps.append(params[po:po + n])
        us.append(updates[uo:uo + n])
    for (wd, scale), (ps, us) in groups.items():
        if lr * wd:  # a factor of exactly 1 changes nothing
            torch._foreach_mul_(ps, 1 - lr * wd)
        torch._foreach_add_(ps, us, alpha=-lr * scale)


__all__ = ["muon_apply", "muon_momentum"]
