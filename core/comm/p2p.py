"""Point to point: blocking and truly asynchronous sends and receives, and batches of them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import dispatch
from .dispatch import call, invoke
from .handles import CommHandle
from .staging import IN, OUT


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    if dispatch.direct:
        return call("send", dist.send, tensor, dst, group, tag, group_dst)
    invoke("send", group, ((tensor, IN),), lambda ts, a: dist.isend(ts[0], dst, group, tag, group_dst), False)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """Blocking receive; returns the sender's rank like torch (``src`` as given when staged)."""
    if dispatch.direct:
        return call("recv", dist.recv, tensor, src, group, tag, group_src)
    invoke("recv", group, ((tensor, OUT),), lambda ts, a: dist.irecv(ts[0], src, group, tag, group_src), False)
    return src if src is not None else group_src


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None) -> CommHandle:
    """Non-blocking send: returns at once with a handle; the tensor must not change until ``wait()``."""
    if dispatch.direct:
        work = call("isend", dist.isend, tensor, dst, group, tag, group_dst)
        return CommHandle("isend", (work,), None, dispatch.timeout_s)
    return invoke("isend", group, ((tensor, IN),), lambda ts, a: dist.isend(ts[0], dst, group, tag, group_dst),
                  True)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None) -> CommHandle:
    """Non-blocking receive: returns at once; ``tensor`` holds the data after ``wait()``."""
    if dispatch.direct:
        work = call("irecv", dist.irecv, tensor, src, group, tag, group_src)
        return CommHandle("irecv", (work,), None, dispatch.timeout_s)
    return invoke("irecv", group, ((tensor, OUT),), lambda ts, a: dist.irecv(ts[0], src, group, tag, group_src),
                  True)


def P2POp(op, tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
          group_peer: int | None = None) -> dist.P2POp:
    """``torch.distributed.P2POp``; ``op`` may be this module's or torch's ``isend``/``irecv``."""
    op = {isend: dist.isend, irecv: dist.irecv}.get(op, op)
    return dist.P2POp(op, tensor, peer, group, tag, group_peer)


def batch_isend_irecv(p2p_op_list) -> list[CommHandle]:
    """Post a batch of sends and receives at once; returns handles to wait on (one per op when not staged)."""
    ops = list(p2p_op_list)
    if not ops:
        return []
    if dispatch.direct:
        works = call("batch_isend_irecv", dist.batch_isend_irecv, ops)
        return [CommHandle("batch_isend_irecv", (w,), None, dispatch.timeout_s) for w in works]
    entries = tuple((p.tensor, IN if p.op is dist.isend else OUT) for p in ops)

    def launch(ts, a):
        staged = [dist.P2POp(p.op, t, p.peer, p.group, p.tag)
                  for p, t in zip(ops, ts, strict=True)]
        return CommHandle("batch_isend_irecv", dist.batch_isend_irecv(staged), None, dispatch.timeout_s)

    return [invoke("batch_isend_irecv", ops[0].group, entries, launch, True)]
