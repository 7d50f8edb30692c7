"""``linear_cross_entropy`` in chunks of tokens: never the whole ``[N, V]`` logits, device-generic torch.

The loop (:func:`make_linear_cross_entropy`) takes a chunk of rows, computes its logits
``hidden[c] @ weight.T (+ bias)`` in the input dtype (the GEMM accumulates in fp32), and from
them the rows' logsumexp and target logit (fp32; fp64 for fp64 input), then turns the logits
chunk into its gradient in place and spends it at once: ``grad_hidden[c] = dz @ weight`` and
``grad_weight += dz.T @ hidden[c]`` (and the bias's). The gradients are thus complete when the
forward returns (the approach of Liger-Kernel's fused linear cross-entropy); the backward only
scales them by the loss's incoming gradient. Peak memory: the gradients of the inputs plus
one chunk's logits (and, in the torch kernels, its fp32 copy).

Chunk size (``chunk_size=None``): ``N / ceil(V / H)`` rounded up to a power of two, at least
:data:`MIN_CHUNK` rows (at most N). With it a chunk's ``[rows, V]`` logits hold about as many
elements as ``hidden``'s ``[N, H]``, so the loss needs about an extra ``hidden`` of memory
whatever the vocabulary (or 1024 rows' logits, when more): :data:`MIN_CHUNK` keeps the GEMMs wide
enough to run at speed (with 256-row chunks a 220M Llama's loss ran slower than the unchunked one).
At Llama-3-8B's shapes (N = 32768, H = 4096, V = 128256) that is 1024 rows (32 chunks).

Vocab-parallel (``group``): each rank computes its shard's per-row logsumexp and target logit,
one all-gather per chunk combines them (logsumexp over the ranks' logsumexps, sum of the target
logits), and the gradients stay with the shard (see :mod:`polyaccel.ops.reference.cross_entropy`).

The per-chunk math is a pair of *chunk kernels* (:class:`TorchChunkKernels` here; the cuda
plugin passes Triton ones): ``stats(z, target) -> (lse, picked)`` per row and
``grad_(z, lse, target, coef, scale) -> dz``, ``target`` being each row's column in this shard
or -1 (ignored, or another shard's class). Optional: ``stats_grad_(z, target, scale, z_loss, row_loss)``
does both (and writes each row's loss term) in one pass over each row when no group has to combine
the statistics first, and
``scale_(g, factor)`` scales a stored gradient by the loss's incoming gradient in the backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import Unsupported
from .reference.cross_entropy import all_reduce, math_dtype

#: the fewest rows a chunk gets from the default rule (fewer when N is smaller)
MIN_CHUNK = 1024

__all__ = ["MIN_CHUNK", "TorchChunkKernels", "default_chunk_size", "linear_cross_entropy",
           "make_linear_cross_entropy"]


def default_chunk_size(n: int, h: int, v: int) -> int:
    """Rows per chunk: ``N / ceil(V / H)`` up to a power of two, at least MIN_CHUNK, at most N (>= 1)."""
    per = math.ceil(n / max(1, math.ceil(v / max(h, 1))))
    return max(1, min(n, max(MIN_CHUNK, 1 << max(per - 1, 0).bit_length())))


class TorchChunkKernels:
    """The chunk math in plain torch (any device)."""

    @staticmethod
    def stats(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: logsumexp of ``z`` and ``z[target]`` (0 where target is -1), in the math dtype."""
        zf = z.to(math_dtype(z.dtype))
        lse = torch.logsumexp(zf, dim=-1)
        mine = target >= 0
        picked = zf.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
        return lse, torch.where(mine, picked, torch.zeros_like(picked))

    @staticmethod
    def grad_(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, coef: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
        """``dz = coef * softmax(z) - scale * onehot(target)`` per row, in z's dtype (in z's memory when it can)."""
        zf = z.to(math_dtype(z.dtype))  # z itself for fp32/fp64 input: then all in place
        zf.sub_(lse.unsqueeze(1)).exp_().mul_(coef.unsqueeze(1))
        mine = target >= 0  # rows whose target is in this shard (no host read: a scatter, not indexing)
        zf.scatter_add_(1, target.clamp(min=0).unsqueeze(1),
                        torch.where(mine, -scale, torch.zeros_like(scale)).unsqueeze(1).to(zf.dtype))
        if zf is not z:
            z.copy_(zf)
        return z


    @staticmethod
    def scale_(g: torch.Tensor, factor: torch.Tensor) -> None:
        """``g *= factor`` (the loss's incoming gradient, a 0-dim tensor), in place."""
        g.mul_(factor)


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` of every rank of ``group``, stacked on a new first dim (through the host for gloo)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    src = t.cpu() if t.device.type != "cpu" and str(dist.get_backend(group)) == "gloo" else t.contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    return torch.stack(parts).to(t.device)


def _vocab_start(group, v_local: int, vocab_start, device) -> int:
    if group is None or vocab_start is not None:
        return int(vocab_start or 0)
    from .contract_loss import vocab_shards

    return vocab_shards("linear_cross_entropy", group, v_local, None, device)[0]


def _chunk_rows(n: int, h: int, v_local: int, chunk_size, group, device) -> int:
    """The chunk size, the same on every rank of ``group`` (one collective per chunk): from the largest shard."""
    if chunk_size is not None:
        return int(chunk_size)
    if group is not None:
        import torch.distributed as dist

        v = torch.tensor([v_local], dtype=torch.int64, device=device)
        v_local = int(all_reduce(v, group, dist.ReduceOp.MAX).item())
    return default_chunk_size(n, h, v_local)


def _denominator(labels_valid: torch.Tensor, reduction: str, num_items, acc: torch.dtype) -> torch.Tensor:
    if reduction == "sum":
        return torch.ones((), dtype=acc, device=labels_valid.device)
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            return num_items.detach().to(labels_valid.device, acc).reshape(())
        return torch.full((), float(num_items), dtype=acc, device=labels_valid.device)  # no host-to-device copy
    return labels_valid.sum().clamp(min=1).to(acc)


def _run(kernels, hidden, weight, bias, labels, ignore_index, reduction, z_loss, num_items, group, vocab_start,
         chunk_size, want: tuple[bool, bool, bool]):
    """The loss and the gradients in ``want`` (of hidden, weight, bias; scaled as for a loss gradient of 1)."""
    n, h = hidden.shape
    v = weight.shape[0]
    acc = math_dtype(hidden.dtype)
    start = _vocab_start(group, v, vocab_start, hidden.device)
    chunk = _chunk_rows(n, h, v, chunk_size, group, hidden.device)
    valid = labels != ignore_index
    inv = 1.0 / _denominator(valid, reduction, num_items, acc)
    scale = valid.to(acc) * inv  # each row's weight in the loss
    local = labels - start
    target = torch.where(valid & (local >= 0) & (local < v), local, -1)
    want_h, want_w, want_b = want
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
    # written by the first chunk's GEMM, accumulated by the others (zeros only when there is no chunk)
    grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=weight.dtype, device=weight.device) \
        if want_w else None
    grad_b = torch.zeros(v, dtype=acc, device=weight.device) if want_b else None
    row_loss = torch.empty(n, dtype=acc, device=hidden.device)  # each row's term, 0 where ignored
    fused = group is None and any(want) and hasattr(kernels, "stats_grad_")
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        h_c = hidden[s:e]
        z = F.linear(h_c, weight, bias)  # [rows, V_local] in the input dtype, fp32 accumulation
        if fused:  # statistics, row losses and gradient in one pass over each row (z becomes dz)
            kernels.stats_grad_(z, target[s:e], scale[s:e], z_loss, row_loss[s:e])
            dz = z
        else:
            dz = _chunk_loss(kernels, z, target[s:e], valid[s:e], scale[s:e], z_loss, group, row_loss[s:e], any(want))
        if want_h:
            torch.mm(dz, weight, out=grad_h[s:e])
        if want_w:
            torch.addmm(grad_w, dz.t(), h_c, beta=1 if s else 0, out=grad_w)
        if want_b:
            grad_b += dz.sum(0, dtype=acc)
        del z, dz  # before the next chunk's logits exist: one chunk at a time, not two
    return row_loss.sum() * inv, grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


def _chunk_loss(kernels, z, target, valid, scale, z_loss, group, row_loss, want_grad: bool):
    """One chunk through ``stats`` (combined over ``group``) and ``grad_``: its rows' losses into ``row_loss``;
    returns ``dz`` (``z`` itself when no gradient is wanted)."""
    lse, picked = kernels.stats(z, target)
    if group is not None:
        both = _all_gather_rows(torch.stack([lse, picked]), group)
        lse, picked = torch.logsumexp(both[:, 0], dim=0), both[:, 1].sum(0)
    rows = lse - picked
    if z_loss:
        rows = rows + z_loss * lse * lse
    torch.where(valid, rows, torch.zeros_like(rows), out=row_loss)
    if not want_grad:
        return z
    coef = scale * (1.0 + 2.0 * z_loss * lse) if z_loss else scale
    return kernels.grad_(z, lse, target, coef, scale)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, kernels, options):
        want = tuple(ctx.needs_input_grad[:3])
        loss, grad_h, grad_w, grad_b = _run(kernels, hidden, weight, bias, labels, *options, want=want)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.kernels = kernels
        ctx.spent = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.spent:
            raise Unsupported("chunked linear_cross_entropy", "a second backward through one call (retain_graph=True)",
                              "its gradients are computed in the forward and scaled in place by the first backward; "
                              "call the op again for another backward")
        ctx.spent = True
        grads = list(ctx.saved_tensors)
        scale_ = getattr(ctx.kernels, "scale_", TorchChunkKernels.scale_)
        for g in grads:
            if g is not None:
                scale_(g, grad_loss.to(g.device))
        return grads[0], grads[1], grads[2], None, None, None


def make_linear_cross_entropy(kernels):
    """The op (the reference's signature) computed in chunks with ``kernels`` (see the module docstring)."""

    def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", z_loss=0.0,
                             num_items=None, group=None, vocab_start=None, chunk_size=None):
        options = (ignore_index, reduction, float(z_loss), num_items, group, vocab_start, chunk_size)
        cast = _autocast_dtype(hidden)
        if cast is not None:  # what autocast makes of the LM head: its GEMM in the autocast dtype
            hidden, weight = hidden.to(cast), weight.to(cast)
            bias = None if bias is None else bias.to(cast)
        tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
        with _no_autocast(hidden):
            if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
                return _run(kernels, hidden, weight, bias, labels, *options, want=(False, False, False))[0]
            return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, kernels, options)

    return linear_cross_entropy


def _autocast_dtype(hidden: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run the head's GEMM in (fp32 input under an enabled autocast), else None."""
    kind = hidden.device.type
    try:
        if hidden.dtype != torch.float32 or not torch.is_autocast_enabled(kind):
            return None
        return torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None


def _no_autocast(hidden: torch.Tensor):
    """The loop runs its GEMMs in the inputs' dtype (already cast above): autocast off, where it exists."""
    import contextlib

    try:
        return torch.autocast(hidden.device.type, enabled=False)
    except (RuntimeError, TypeError):
        return contextlib.nullcontext()


#: the chunked op with the torch chunk kernels: the cpu builder and the default on every device type
linear_cross_entropy = make_linear_cross_entropy(TorchChunkKernels)
