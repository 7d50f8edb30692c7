"""The routed experts of an AutoEP layer replayed from device graphs (``capture_graphs``).

Where few tokens reach a MoE layer its step is bound by the host: the routed path is about twenty launches
and half a dozen autograd nodes each way. Captured once per input shape as a forward and a backward graph
(one memory pool), each call becomes a few input copies and one replay per direction inside one autograd
node; the router stays eager. A graph is bound to fixed memory, so what it cannot replay correctly (ep > 1,
no grad mode, autocast, a second forward before the pending backward, moved or hooked expert parameters, a
host read while capturing, more than :data:`MAX_SHAPES` shapes) runs eagerly or is refused: the full list is
in docs/autoep.md, "Replaying the routed experts from device graphs".
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from polyaccel.errors import PolyaccelError

#: input shapes captured per layer (each holds its pool); further shapes run eagerly, with one warning
MAX_SHAPES = 4
#: forward + backward runs before capture (kernels compiled, autotuned and libraries set up outside capture)
WARMUP_RUNS = 2


def accelerator_for(device: torch.device):
    """The accelerator serving ``device`` (looked up here, so tests can stand in a device with graphs)."""
    from polyaccel.selection import accelerator_for_device_type

    acc = accelerator_for_device_type(device.type)
    if acc is None:
        raise PolyaccelError(f"capture_graphs: no usable polyaccel accelerator serves device type {device.type!r}")
    return acc


class _OutOfMemory(Exception):
    """A capture that ran out of device memory (that shape then runs eagerly)."""


class _Pending:
    """Held by the autograd node of one replayed forward; while it lives its backward is still due."""


@dataclass
class _Captured:
    """One input shape's forward and backward graphs and the static tensors bound to them."""

    acc: object
    inputs: tuple[torch.Tensor, ...]  # x, weights, idx
    params: tuple[torch.nn.Parameter, ...]  # every expert parameter, trained or not: the graphs read them all
    param_ptrs: tuple[int, ...]
    fwd: object = None
    bwd: object = None
    out: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)  # static tensors the layer reports (the expert counts)
    grad_out: torch.Tensor | None = None
    grads: tuple = ()  # aligned with (x, weights, *trained parameters); None where no gradient is wanted
    trained: tuple[torch.nn.Parameter, ...] = ()  # the parameters that take a gradient, in ``grads`` order
    own_users: tuple[int, ...] = ()  # per weight gradient, the tensors on its memory right after capture
    fn: Callable | None = None  # the eager route: the backward's fallback recomputes with it
    count: Callable[[str], None] = lambda what: None  # the layer's stats counter
    pending: weakref.ref | None = None
    replays: int = 0  # forward replays so far: a backward belongs to the forward replay it was made with

    def backward_due(self) -> bool:
        return self.pending is not None and self.pending() is not None


#: torch's count of the tensors on one storage (None where this torch has none: gradients are then never lent)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (``t`` included); 0 where torch cannot say."""
    if _storage_use_count is None:
        return 0
    return _storage_use_count(t.untyped_storage()._cdata) - 1  # (less the storage object made here)


def _reclaim(entry: _Captured) -> bool:
    """Whether the backward graph may write its weight gradients' memory again: lent out as ``.grad`` by the
    last backward, it must be back. A ``.grad`` still on it (gradients accumulating over micro-batches) moves
    to a copy, which the next gradient is then added to; any other holder keeps it, and False is returned."""
    for p, g, own in zip(entry.trained, entry.grads[2:], entry.own_users, strict=True):
        if g is None or _users(g) == own:
            continue
        if p.grad is not None and p.grad.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
            p.grad = p.grad.clone()
        if _users(g) != own:
            return False
    return True


def _recompute(entry: _Captured, grad_out: torch.Tensor) -> tuple:
    """This forward's gradients computed eagerly from its inputs (still in the static tensors: no replay since)."""
    x, weights, idx = (t.detach().requires_grad_(t.requires_grad) for t in entry.inputs)
    ins = (x, weights, *entry.trained)
    wanted = [t for t in ins if t.requires_grad]
    with torch.enable_grad(), _own_saved_tensors():
        out, _ = entry.fn(x, weights, idx)
        got = iter(torch.autograd.grad(out, wanted, grad_outputs=grad_out, allow_unused=True))
    return tuple(next(got) if t.requires_grad else None for t in ins)


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs in, replay the forward graph. Backward: copy the output's gradient in,
    replay the backward graph, hand back the static gradients.

    The weight gradients go back as aliases, so autograd adopts them as ``.grad`` where that is None
    instead of copying them (for many experts and few tokens the copy costs more than the launches a
    graph saves); the next backward takes their memory back first (:func:`_reclaim`). Where something
    else still holds it, that backward recomputes eagerly instead of overwriting it.
    """

    @staticmethod
    def forward(ctx, entry: _Captured, x, weights, idx, *trained):
        for static, given in zip(entry.inputs, (x, weights, idx), strict=True):
            static.copy_(given)
        entry.acc.replay_graph(entry.fwd)
        entry.replays += 1
        token = _Pending()
        entry.pending = weakref.ref(token)
        ctx.entry, ctx.token, ctx.replay = entry, token, entry.replays
        return entry.out.clone()  # the caller's own tensor: the next replay rewrites the static one

    @staticmethod
    def backward(ctx, grad_out):
        entry = ctx.entry
        if ctx.replay != entry.replays:
            raise PolyaccelError("capture_graphs: this layer's forward graph ran again since the forward this backward "
                                 "belongs to (a backward through a retained graph after a later forward), so the "
                                 "activations it needs are gone; set expert_parallel.capture_graphs to false for this")
        moved = [i for i, (p, at) in enumerate(zip(entry.params, entry.param_ptrs, strict=True)) if p.data_ptr() != at]
        if moved:
            raise PolyaccelError(
                f"capture_graphs: expert parameter(s) {moved} moved to new storage between this layer's forward and "
                "its backward (ZeRO stage 3 gathers parameters again for backward), and the backward graph reads "
                "them where they were; use ZeRO stage 1 or 2 with capture_graphs, or set it to false")
        entry.pending = None
        if not _reclaim(entry):
            entry.count("backward eagerly: a weight gradient lent out is still held")
            gx, gw, *gp = _recompute(entry, grad_out)
            return (None, gx, gw, None, *gp)
        entry.grad_out.copy_(grad_out)
        entry.acc.replay_graph(entry.bwd)
        gx, gw, *gp = entry.grads  # the input gradients as themselves: autograd adds or copies them, never keeps them
        return (None, gx, gw, None, *(g.detach() if g is not None and _storage_use_count else g for g in gp))


class GraphedRoute:
    """Captures and replays one layer's routed experts, ``fn(x, weights, idx) -> y``, per input shape.

    ``fn`` also returns the static tensors the layer reports after each call (``extras``, e.g. the
    expert counts), which a replay rewrites in place.
    """

    def __init__(self, fn: Callable, experts: torch.nn.Module, name: str = "AutoEP layer"):
        self.fn = fn
        self.experts = experts
        self.name = name
        self.entries: dict[tuple, _Captured] = {}
        self.uncapturable: set[tuple] = set()  # shapes whose capture ran out of device memory: eager
        #: how calls went: replayed, captured, eager (and why)
        self.stats: dict[str, int] = {}
        self._warned: set[str] = set()

    def __getstate__(self):
        """A copy (``copy.deepcopy`` of the model, pickling) captures afresh: graphs are bound to this one's memory."""
        state = self.__dict__.copy()
        state["entries"], state["stats"], state["uncapturable"], state["_warned"] = {}, {}, set(), set()
        return state

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"capture_graphs: {self.name}: {message}", RuntimeWarning, stacklevel=4)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
        """``(y, extras)`` from the graphs, or None where this call must run eagerly (counted in ``stats``)."""
        why = self._eager_reason(x, weights)
        if why is not None:
            self._count(f"eager: {why}")
            return None
        self._refuse_hooks()
        params = tuple(self.experts.parameters())
        key = (tuple(x.shape), x.dtype, x.device, x.requires_grad, tuple(weights.shape), weights.dtype,
               weights.requires_grad, idx.dtype, tuple((p.dtype, p.requires_grad) for p in params))
        entry = self.entries.get(key)
        if entry is not None and entry.param_ptrs != tuple(p.data_ptr() for p in params):
            self.entries.clear()  # the parameters moved: every graph of this layer reads the old storage
            self._count("recaptured: parameters moved")
            entry = None
        if entry is None:
            if key in self.uncapturable:
                self._count("eager: capture ran out of device memory")
                return None
            if len(self.entries) >= MAX_SHAPES:
                self._count("eager: shapes beyond MAX_SHAPES")
                self._warn_once("shapes", f"more than {MAX_SHAPES} input shapes; the others run eagerly (pad batches "
                                          "to a few fixed lengths to replay them all)")
                return None
            try:
                entry = self._capture(x, weights, idx, params)
            except _OutOfMemory as exc:
                self.uncapturable.add(key)
                self._count("eager: capture ran out of device memory")
                self._warn_once(f"oom {key[0]}", f"capturing input {key[0]} ran out of device memory ({exc}); that "
                                                  "shape runs eagerly")
                return None
            self.entries[key] = entry
            self._count("captured")
        elif entry.backward_due():
            # e.g. activation checkpointing's recompute in backward: the original forward was replayed and saved
            # nothing through the checkpoint's hooks, so neither may this eager run
            self._count("eager: the previous forward's backward is still due")
            with _own_saved_tensors():
                return self.fn(x, weights, idx)
        y = _Replay.apply(entry, x, weights, idx, *(p for p in params if p.requires_grad))
        self._count("replayed")
        return y, entry.extras

    @staticmethod
    def _eager_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
        if not torch.is_grad_enabled():
            return "grad mode off"
        if torch.is_autocast_enabled(x.device.type):
            return "autocast"
        if x.numel() == 0:
            return "no tokens"
        return None

    def _refuse_hooks(self) -> None:
        hooked = [n or "(experts)" for n, m in self.experts.named_modules()
                  if m._forward_pre_hooks or m._forward_hooks]
        if hooked:
            raise PolyaccelError(
                f"capture_graphs: {self.name}'s expert module(s) {', '.join(hooked)} have forward hooks, which a graph "
                "replay would skip (ZeRO stage 3 gathers the experts' parameters in such hooks). Use ZeRO stage 1 or "
                "2 with capture_graphs, or set capture_graphs to false")

    def _capture(self, x, weights, idx, params) -> _Captured:
        acc = accelerator_for(x.device)
        acc.require("graphs", "set expert_parallel.capture_graphs to false: this backend has no device graphs")
        static = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in (x, weights)) + (idx.clone(),)
        trained = [p for p in params if p.requires_grad]
        wanted = [t for t in (*static[:2], *trained) if t.requires_grad]
        entry = _Captured(acc=acc, inputs=static, params=params, param_ptrs=tuple(p.data_ptr() for p in params),
                          trained=tuple(trained), fn=self.fn, count=self._count)
        try:
            with _own_saved_tensors(), _side_stream(acc):
                for _ in range(WARMUP_RUNS):
                    out, _ = self.fn(*static)
                    torch.autograd.grad(out, wanted, grad_outputs=torch.ones_like(out), allow_unused=True)
                del out
            entry.fwd = acc.create_graph()
            with _own_saved_tensors(), acc.capture_to_graph(entry.fwd):
                entry.out, entry.extras = self.fn(*static)
            entry.grad_out = torch.empty_like(entry.out)
            entry.bwd = acc.create_graph()
            pool = entry.fwd.pool() if hasattr(entry.fwd, "pool") else None
            with _own_saved_tensors(), acc.capture_to_graph(entry.bwd, pool=pool):
                got = torch.autograd.grad(entry.out, wanted, grad_outputs=entry.grad_out, allow_unused=True)
        except PolyaccelError:
            raise
        except torch.OutOfMemoryError as exc:
            raise _OutOfMemory(str(exc).splitlines()[0] if str(exc) else "out of memory") from exc
        except Exception as exc:
            raise PolyaccelError(
                f"capture_graphs: capturing {self.name}'s routed experts for input {tuple(x.shape)} {x.dtype} failed "
                f"({type(exc).__name__}: {exc}). Every op on the path must run without reading values back to the "
                "host; `polyaccel.ops.explain('grouped_mm')` (and swiglu, gather_sum) names the builders in use. Set "
                "expert_parallel.capture_graphs to false to run eagerly") from exc
        got = iter(got)
        entry.grads = tuple(next(got) if t.requires_grad else None for t in (*static[:2], *trained))
        entry.own_users = tuple(_users(g) if g is not None else 0 for g in entry.grads[2:])
        return entry


def _own_saved_tensors():
    """Autograd saves tensors as they are within: outer saved-tensor hooks (activation checkpointing's) must
    neither see the capture's own graphs (unpacking one would start a recompute mid-capture) nor tensors of an
    eager run the replayed forward it stands in for did not save."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t):
    return t


@contextlib.contextmanager
def _side_stream(acc):
    """Run the block on a fresh stream where the device has streams (warm-up away from the current stream,
    as capture needs), else in place."""
    if not acc.has("streams"):
        yield
        return
    side, current = acc.Stream(), acc.current_stream()
    side.wait_stream(current)
    with acc.stream(side):
        yield
    current.wait_stream(side)
