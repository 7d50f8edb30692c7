"""Triton ``logprobs``, ``entropy`` and ``kl`` over (possibly vocab-parallel) logits: one pass forward, one back.

Forward: one program per row reads the row once in blocks of columns and keeps online partials
(fp32 math, fp64 for fp64 logits): the max ``m``, ``s = sum exp(z - m)`` and, per op, the target's
logit (logprobs), ``t = sum exp(z - m) * z`` (entropy), or for KL both rows' ``m, s`` and
``t = sum exp(zp - mp) * (zp - zq)``. The partials of the ranks of a vocab-parallel group are
combined by one all-gather (``M = max m_r``, ``S = sum s_r exp(m_r - M)``, ...); then
``lse = M + log S`` and the results are closed forms of the partials. Backward: one elementwise pass
(a 2-D grid over rows and column blocks) from the saved logits and per-row values, the reference's
formulas (:mod:`polyaccel.ops.reference.cross_entropy`). Nothing of size ``[N, V]`` is allocated
besides the gradients; torch's composition makes an fp32 copy and several fp32 temporaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from polyaccel.ops.chunked_loss import _all_gather_rows

BLOCK_V = 4096
NUM_WARPS = 8
LOGPROBS, ENTROPY, KL = 0, 1, 2


@triton.jit
def _online(m, s, t, z, w, HAS_T: tl.constexpr):
    """One block's update of the partials: max m, s = sum exp(z - m), t = sum exp(z - m) * w."""
    m_new = tl.maximum(m, z)
    alive = m_new != float("-inf")
    scale = tl.where(alive, tl.exp(m - m_new), 0.0)
    e = tl.where(alive, tl.exp(z - m_new), 0.0)
    s = s * scale + e
    if HAS_T:
        t = t * scale + e * w
    return m_new, s, t


@triton.jit
def _reduce(m, s, t):
    row_max = tl.max(m, 0)
    f = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max))
    return row_max, tl.sum(s * f, 0), tl.sum(t * f, 0)


@triton.jit
def _forward_kernel(p_ptr, q_ptr, target_ptr, out_ptr, V, stride_p, stride_q, MODE: tl.constexpr,
                    ACC: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = (m, s, t, mq, sq): the partials of this rank's columns (t: picked logit for logprobs)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), ACC)
    s = tl.zeros((BLOCK,), ACC)
    t = tl.zeros((BLOCK,), ACC)
    mq = tl.full((BLOCK,), float("-inf"), ACC)
    sq = tl.zeros((BLOCK,), ACC)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        zp = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=float("-inf")).to(ACC)
        if MODE == 2:
            zq = tl.load(q_ptr + row * stride_q + offs, mask=mask, other=float("-inf")).to(ACC)
            m, s, t = _online(m, s, t, zp, tl.where(mask, zp - zq, 0.0), True)
            mq, sq, _unused_t = _online(mq, sq, sq, zq, zq, False)
        elif MODE == 1:
            m, s, t = _online(m, s, t, zp, tl.where(mask, zp, 0.0), True)
        else:
            m, s, t = _online(m, s, t, zp, zp, False)
    row_max, total, weighted = _reduce(m, s, t)
    base = out_ptr + row * 5
    tl.store(base, row_max)
    tl.store(base + 1, total)
    if MODE == 0:
        tgt = tl.load(target_ptr + row)
        picked = tl.load(p_ptr + row * stride_p + tl.maximum(tgt, 0)).to(ACC)
        tl.store(base + 2, tl.where(tgt >= 0, picked, 0.0))
    else:
        tl.store(base + 2, weighted)
    if MODE == 2:
        q_max, q_total, _unused = _reduce(mq, sq, sq)
        tl.store(base + 3, q_max)
        tl.store(base + 4, q_total)


@triton.jit
def _backward_kernel(p_ptr, q_ptr, target_ptr, rowv_ptr, grad_ptr, dp_ptr, dq_ptr, V, stride_p, stride_q,
                     MODE: tl.constexpr, NEED_DQ: tl.constexpr, BLOCK: tl.constexpr):
    """rowv[row] = (lse, lse_q, c): c is the entropy H (entropy) or d = sum p (zp - zq) (kl)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < V
    lse = tl.load(rowv_ptr + row * 3)
    g = tl.load(grad_ptr + row)
    zp = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=0.0).to(lse.dtype)
    p = tl.exp(zp - lse)
    if MODE == 0:
        d = tl.where(offs == tl.load(target_ptr + row), 1.0 - p, -p) * g
    elif MODE == 1:
        d = -g * p * (zp - lse + tl.load(rowv_ptr + row * 3 + 2))
    else:
        zq = tl.load(q_ptr + row * stride_q + offs, mask=mask, other=0.0).to(lse.dtype)
        d = g * p * (zp - zq - tl.load(rowv_ptr + row * 3 + 2))
        if NEED_DQ:
            dq = g * (tl.exp(zq - tl.load(rowv_ptr + row * 3 + 1)) - p)
            tl.store(dq_ptr + row * V + offs, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_ptr + row * V + offs, d.to(dp_ptr.dtype.element_ty), mask=mask)


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, V]`` rows of unit column stride (a view when it can be, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def _combine(part: torch.Tensor, group) -> torch.Tensor:
    """Per row (lse, t / s or picked, lse_q) of the whole vocabulary from the ranks' partials ``[R, 5]``."""
    if group is None:
        parts = part.unsqueeze(0)
    else:
        parts = _all_gather_rows(part, group)
    m, s, t, mq, sq = parts.unbind(-1)
    big = m.amax(0)
    f = torch.exp(m - big)
    total = (s * f).sum(0)
    lse = big + torch.log(total)
    big_q = mq.amax(0)
    lse_q = big_q + torch.log((sq * torch.exp(mq - big_q)).sum(0))
    return lse, t.sum(0), (t * f).sum(0) / total, lse_q


class _LogitsOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mode, logits_p, logits_q, labels, vocab_start, group):
        shape = logits_p.shape[:-1]
        p = _rows(logits_p)
        q = _rows(logits_q) if logits_q is not None else p
        rows, v = p.shape
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        target = p.new_empty(0, dtype=torch.int64)
        if mode == LOGPROBS:
            local = labels.reshape(-1) - vocab_start
            target = torch.where((local >= 0) & (local < v), local, -1).contiguous()
        part = torch.zeros(rows, 5, dtype=acc, device=p.device)
        if rows:
            block = min(BLOCK_V, max(16, triton.next_power_of_2(v)))
            _forward_kernel[(rows,)](p, q, target if mode == LOGPROBS else part, part, v, p.stride(0), q.stride(0),
                                     MODE=mode, ACC=_acc(p.dtype), BLOCK=block, num_warps=NUM_WARPS)
        lse, picked, mean_w, lse_q = _combine(part, group)
        if mode == LOGPROBS:
            out, c = picked - lse, torch.zeros_like(lse)
        elif mode == ENTROPY:
            out = c = lse - mean_w
        else:
            c = mean_w
            out = c - lse + lse_q
        ctx.save_for_backward(p, q if logits_q is not None else None, target, torch.stack([lse, lse_q, c], 1))
        ctx.mode, ctx.shape = mode, (logits_p.shape, None if logits_q is None else logits_q.shape)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        p, q, target, rowv = ctx.saved_tensors
        rows, v = p.shape
        need_dq = ctx.mode == KL and ctx.needs_input_grad[2]
        dp = torch.empty((rows, v), dtype=p.dtype, device=p.device)
        dq = torch.empty((rows, v), dtype=q.dtype, device=q.device) if need_dq else dp
        if rows:
            block = min(BLOCK_V, max(16, triton.next_power_of_2(v)))
            g = grad.reshape(-1).to(rowv.dtype).contiguous()
            qq = q if q is not None else p
            _backward_kernel[(rows, triton.cdiv(v, block))](
                p, qq, target if ctx.mode == LOGPROBS else rowv, rowv.contiguous(), g, dp, dq, v, p.stride(0),
                qq.stride(0), MODE=ctx.mode, NEED_DQ=need_dq, BLOCK=block, num_warps=NUM_WARPS)
        shape_p, shape_q = ctx.shape
        return (None, dp.view(shape_p), dq.view(shape_q) if need_dq else None, None, None, None)


def logprobs(logits, labels, *, group=None, vocab_start=None):
    if group is not None and vocab_start is None:
        from polyaccel.ops.contract_loss import vocab_shards

        vocab_start = vocab_shards("logprobs", group, logits.shape[-1], None, logits.device, labels.numel())[0]
    return _LogitsOp.apply(LOGPROBS, logits, None, labels, int(vocab_start or 0), group)


def entropy(logits, *, group=None):
    return _LogitsOp.apply(ENTROPY, logits, None, None, 0, group)


def kl(logits_p, logits_q, *, group=None):
    return _LogitsOp.apply(KL, logits_p, logits_q, None, 0, group)
