"""The routed experts of an AutoEP layer replayed from device graphs (``capture_graphs``).

Where few tokens reach a MoE layer its step is bound by the host: the routed path is about twenty launches
and half a dozen autograd nodes each way. Captured once per input shape as a forward and a backward graph,
each call becomes a few input copies and one replay per direction inside one autograd node; the router
stays eager. A graph is bound to fixed memory, so what it cannot replay correctly (ep > 1, no grad mode,
autocast, a forward while one of the layer's backwards is due, moved or hooked expert parameters, a host
read while capturing, more than :data:`MAX_SHAPES` shapes) runs eagerly or, with ``capture_graphs: true``,
is refused: the full list is in docs/autoep.md, "Replaying the routed experts from device graphs".

``capture_graphs: "auto"`` (the default) replays only where graphs pay and never raises for what a graph
cannot do: that call runs eagerly, counted in ``stats`` with the reason. It pads the token count up to a
bucket (:func:`bucket_tokens`) so a layer sees few shapes, leaves rows above :data:`AUTO_MAX_ROUTED_ROWS`
(bound by the device) eager, and stops capturing once the graphs hold :data:`AUTO_POOL_BUDGET_FRACTION` of
the device's memory.

One memory pool per layer
-------------------------
All graphs of a layer, every shape forward and backward, are captured into one memory pool, so the pool's
size is about the largest shape's working memory, not the sum over shapes. A graph writes, on replay, all
the memory allocated while it was captured: its static outputs and its scratch (temporaries, and the
activations its backward reads). A tensor that was alive during a capture is never part of that capture's
memory; a tensor allocated by a later capture may sit in an earlier graph's scratch, which the allocator
had got back when the earlier capture ended. So, within a layer:

- the activations a replayed forward leaves for its backward sit in pool memory that any other graph of the
  layer may write: no forward of the layer is replayed while any of its backwards is due (that forward
  runs eagerly);
- what a replay hands out (the output, the expert counts, the input gradients) is valid until the layer's
  next replay, and is copied or consumed before it (the output and counts are cloned, autograd adds or
  copies the input gradients within the same backward);
- the weight gradients lent out as ``.grad`` outlive that: before any forward replay of the layer every
  lent gradient is taken back (:func:`_reclaim`), or that forward runs eagerly;
- the static inputs and the output's gradient are allocated outside capture (never in the pool).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from polyaccel.errors import PolyaccelError

#: input shapes captured per layer (sharing the layer's pool); further shapes run eagerly, with one warning
MAX_SHAPES = 4
#: ``capture_graphs: "auto"``: a call routing more rows (bucketed tokens x top_k) than this runs eagerly. On an
#: H100 (benchmarks/RESULTS.md, H 2048, F 1536, bf16) graphs win at 4096 tokens x top-2 (8192 rows: the eager
#: step is bound by the host, 1.18-1.53x HF grouped_mm eager vs 1.65-2.44x replayed) and cost up to 4% where
#: the device is the bound (32768 rows: 4096 x top-8; 65536: 32768 x top-2)
AUTO_MAX_ROUTED_ROWS = 16384
#: ``capture_graphs: "auto"``: no layer captures once the graphs of all layers on a device hold this share of
#: its memory (measured as the growth of the device's reserved memory over each capture)
AUTO_POOL_BUDGET_FRACTION = 0.1
#: ``capture_graphs: "auto"`` on an accelerator without memory statistics: shapes captured per layer
AUTO_SHAPES_UNMEASURED = 2
#: ``capture_graphs: "auto"``: token counts up to this are padded to it (the smallest bucket)
MIN_BUCKET = 16
#: forward + backward runs before capture (kernels compiled, autotuned and libraries set up outside capture)
WARMUP_RUNS = 2


def bucket_tokens(tokens: int) -> int:
    """The token count a call of ``tokens`` is padded to under ``"auto"``: :data:`MIN_BUCKET` at most, else
    the next multiple of an eighth of the power of two at or above ``tokens`` (4 sizes per doubling, at most
    25% pad rows), so a layer fed varying batch lengths captures few shapes."""
    if tokens <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << max(0, (tokens - 1).bit_length() - 3)
    return -(-tokens // step) * step


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
    """One input shape's forward and backward graphs and the static tensors bound to them.

    Under ``"auto"`` the static inputs have ``rows`` rows (the bucket); a call of fewer tokens fills the
    first ones, the rest are pad rows that change no result (zero hidden states and routing weights, the
    expert ids 0..k-1) and add ``rows - tokens`` rows to each of experts 0..k-1 in the counts."""

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
    rows: int = 0  # rows of the static inputs
    filled: int = 0  # rows of the static inputs (and of ``grad_out``) holding a call's values, the rest pad
    grad_filled: int = 0
    lent: bool = False  # weight gradients handed to autograd and not yet known to be back
    held: int = 0  # device memory the capture added (0 where not measured)
    pad_ids: torch.Tensor | None = None  # a pad row's expert ids, 0..k-1

    def backward_due(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def load(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> None:
        """The call's inputs into the static ones; rows a longer earlier call filled become pad rows again."""
        n = x.shape[0]
        for static, given in zip(self.inputs, (x, weights, idx), strict=True):
            (static[:n] if n < self.rows else static).copy_(given)
        if n < self.filled:
            sx, sw, sidx = self.inputs
            sx[n:self.filled].zero_()
            sw[n:self.filled].zero_()
            sidx[n:self.filled].copy_(self.pad_ids)
        self.filled = n

    def load_grad(self, grad_out: torch.Tensor) -> None:
        n = grad_out.shape[0]
        if n < self.rows:
            self.grad_out[:n].copy_(grad_out)
            if n < self.grad_filled:
                self.grad_out[n:self.grad_filled].zero_()
        else:
            self.grad_out.copy_(grad_out)
        self.grad_filled = n


#: torch's count of the tensors on one storage (None where this torch has none: gradients are then never lent)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (``t`` included); 0 where torch cannot say."""
    if _storage_use_count is None:
        return 0
    return _storage_use_count(t.untyped_storage()._cdata) - 1  # (less the storage object made here)


def _reclaim(entry: _Captured) -> bool:
    """Whether the graphs may write the weight gradients' memory again: lent out as ``.grad`` by the last
    backward, it must be back. A ``.grad`` still on it (gradients accumulating over micro-batches) moves to a
    copy, which the next gradient is then added to; any other holder keeps it, and False is returned."""
    if not entry.lent:
        return True
    for p, g, own in zip(entry.trained, entry.grads[2:], entry.own_users, strict=True):
        if g is None or _users(g) == own:
            continue
        if p.grad is not None and p.grad.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
            p.grad = p.grad.clone()
        if _users(g) != own:
            return False
    entry.lent = False
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
    replay the backward graph, hand back the static gradients (the call's rows of them).

    The weight gradients go back as aliases, so autograd adopts them as ``.grad`` where that is None
    instead of copying them (for many experts and few tokens the copy costs more than the launches a
    graph saves); the next replay of the layer takes their memory back first (:func:`_reclaim`). Where
    something else still holds it, that forward (or backward) runs eagerly instead of overwriting it.
    """

    @staticmethod
    def forward(ctx, entry: _Captured, x, weights, idx, *trained):
        n = x.shape[0]
        entry.load(x, weights, idx)
        entry.acc.replay_graph(entry.fwd)
        entry.replays += 1
        token = _Pending()
        entry.pending = weakref.ref(token)
        ctx.entry, ctx.token, ctx.replay, ctx.rows = entry, token, entry.replays, n
        out = entry.out[:n] if n < entry.rows else entry.out
        return out.clone()  # the caller's own tensor: the next replay rewrites the static one

    @staticmethod
    def backward(ctx, grad_out):
        entry, n = ctx.entry, ctx.rows
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
        entry.load_grad(grad_out)
        if not _reclaim(entry):
            entry.count("backward eagerly: a weight gradient lent out is still held")
            gx, gw, *gp = _recompute(entry, entry.grad_out)
            return (None, _rows(gx, n), _rows(gw, n), None, *gp)
        entry.acc.replay_graph(entry.bwd)
        entry.lent = True
        gx, gw, *gp = entry.grads  # the input gradients as themselves: autograd adds or copies them, never keeps them
        return (None, _rows(gx, n), _rows(gw, n), None,
                *(g.detach() if g is not None and _storage_use_count else g for g in gp))


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return t if t is None or t.shape[0] == n else t[:n]


#: every layer's graphs (for the memory they hold together on a device)
_ROUTES: weakref.WeakSet = weakref.WeakSet()


class _Weak:
    """A bound method called through a weak reference: the layer holds its graphs, so its graphs (and their
    entries) hold the layer's route and the stats counter weakly; dropping the layer then frees its graphs and
    pool at once, without waiting for the garbage collector (whose delay would also count them in the budget)."""

    def __init__(self, method) -> None:
        self.ref = weakref.WeakMethod(method)

    def __call__(self, *args):
        return self.ref()(*args)


def _weak(fn: Callable) -> Callable:
    return _Weak(fn) if hasattr(fn, "__self__") and hasattr(fn, "__func__") else fn


def held_bytes(device: torch.device) -> int:
    """The device memory the captures of all layers on ``device`` added (where measured)."""
    return sum(e.held for r in list(_ROUTES) for e in r.entries.values() if r.device == device)


class GraphedRoute:
    """Captures and replays one layer's routed experts, ``fn(x, weights, idx) -> y``, per input shape.

    ``fn`` also returns the static tensors the layer reports after each call (``extras``, e.g. the
    expert counts), which a replay rewrites in place. ``auto``: ``capture_graphs: "auto"`` (the call
    runs eagerly where a graph cannot serve or does not pay, and the token count is bucketed);
    ``ep_size`` > 1 under ``auto`` always runs eagerly.
    """

    def __init__(self, fn: Callable, experts: torch.nn.Module, name: str = "AutoEP layer", *, auto: bool = False,
                 ep_size: int = 1):
        self.fn = _weak(fn)
        self.experts = experts
        self.name = name
        self.auto = auto
        self.ep_size = ep_size
        self.entries: dict[tuple, _Captured] = {}
        self.uncapturable: dict[tuple, str] = {}  # shapes that run eagerly, and why (their capture failed)
        #: how calls went: replayed, captured, eager (and why)
        self.stats: dict[str, int] = {}
        self._warned: set[str] = set()
        self._device_reasons: dict[torch.device, str | None] = {}  # auto: a device's eager stat key, decided once
        self.pool = None  # the layer's memory pool, shared by all its graphs (None until the first capture)
        self.device: torch.device | None = None
        _ROUTES.add(self)

    def __getstate__(self):
        """A copy (``copy.deepcopy`` of the model, pickling) captures afresh: graphs are bound to this one's memory."""
        state = self.__dict__.copy()
        state["entries"], state["stats"], state["uncapturable"], state["_warned"] = {}, {}, {}, set()
        state["_device_reasons"], state["pool"], state["device"] = {}, None, None
        state["fn"] = self.fn.ref() if isinstance(self.fn, _Weak) else self.fn  # (the copy's own layer's method)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fn = _weak(self.fn)
        _ROUTES.add(self)

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"capture_graphs: {self.name}: {message}", RuntimeWarning, stacklevel=4)

    def _eager(self, why: str) -> None:
        self._count(f"eager: {why}")

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
        """``(y, extras, pad)`` from the graphs, or None where this call must run eagerly (counted in ``stats``).
        ``pad``: the pad rows the graphs ran besides the call's tokens, each routed to experts 0..k-1 (the
        extras count them)."""
        if self.auto:
            if torch.compiler.is_compiling():  # torch.compile traces the eager layer (and makes its own graphs)
                return None
            eager_key = self._device_reasons.get(x.device, "")
            if eager_key == "":
                why = self._device_reason(x.device)
                eager_key = self._device_reasons[x.device] = None if why is None else f"eager: {why}"
            if eager_key is not None:  # (the cpu: the one dictionary look-up and count a call)
                self.stats[eager_key] = self.stats.get(eager_key, 0) + 1
                return None
            why = self._eager_reason(x, weights)
            if why is None and self._hooked():
                why = "expert modules have forward hooks (ZeRO stage 3 gathers parameters there)"
            rows = bucket_tokens(x.shape[0])
            if why is None and rows * idx.shape[1] > AUTO_MAX_ROUTED_ROWS:
                why = "routed rows above AUTO_MAX_ROUTED_ROWS (bound by the device)"
        else:
            why = self._eager_reason(x, weights)
            if why is None:
                self._refuse_hooks()
            rows = x.shape[0]
        if why is not None:
            self._eager(why)
            return None
        params = tuple(self.experts.parameters())
        key = ((rows, *x.shape[1:]), x.dtype, x.device, x.requires_grad, tuple(weights.shape[1:]), weights.dtype,
               weights.requires_grad, idx.dtype, tuple((p.dtype, p.requires_grad) for p in params))
        entry = self.entries.get(key)
        if entry is not None and entry.param_ptrs != tuple(p.data_ptr() for p in params):
            self.entries.clear()  # the parameters moved: every graph of this layer reads the old storage
            self.pool = None
            self._count("recaptured: parameters moved")
            entry = None
        if any(e.backward_due() for e in self.entries.values()):
            # e.g. activation checkpointing's recompute in backward, or a layer called twice: the pending
            # backward's activations are in the layer's pool, which any replay of the layer may write. The
            # replayed forward saved nothing through the checkpoint's hooks, so neither may this eager run
            self._eager("the previous forward's backward is still due")
            with _own_saved_tensors():
                y, extras = self.fn(x, weights, idx)
            return y, extras, 0
        if not all(_reclaim(e) for e in self.entries.values()):
            self._eager("a weight gradient lent out is still held")
            return None
        if entry is None:
            entry = self._new_entry(key, x, weights, idx, params, rows)
            if entry is None:
                return None
        y = _Replay.apply(entry, x, weights, idx, *(p for p in params if p.requires_grad))
        self._count("replayed")
        return y, entry.extras, rows - x.shape[0]

    def _new_entry(self, key, x, weights, idx, params, rows) -> _Captured | None:
        """The shape's graphs captured (counted), or None where it runs eagerly (counted)."""
        if key in self.uncapturable:
            self._eager(self.uncapturable[key])
            return None
        if len(self.entries) >= MAX_SHAPES:
            self._eager("shapes beyond MAX_SHAPES")
            self._warn_once("shapes", f"more than {MAX_SHAPES} input shapes; the others run eagerly (pad batches "
                                      "to a few fixed lengths to replay them all)")
            return None
        acc = accelerator_for(x.device)
        if self.auto and not self._within_budget(acc, x.device):
            self._eager("graph memory budget spent")
            return None
        try:
            entry = self._capture(acc, x, weights, idx, params, rows)
        except _OutOfMemory as exc:
            self.uncapturable[key] = "capture ran out of device memory"
            self._eager(self.uncapturable[key])
            self._warn_once(f"oom {key[0]}", f"capturing input {key[0]} ran out of device memory ({exc}); that "
                                              "shape runs eagerly")
            return None
        except PolyaccelError as exc:
            if not self.auto:
                raise
            self.uncapturable[key] = "capture failed"
            self._eager(self.uncapturable[key])
            cause = exc.__cause__ or exc
            self._warn_once(f"failed {key[0]}", f"capturing input {key[0]} failed ({type(cause).__name__}: {cause}); "
                                                "that shape runs eagerly (capture_graphs \"auto\")")
            return None
        self.entries[key] = entry
        self.device = x.device
        self._count("captured")
        return entry

    def _device_reason(self, device: torch.device) -> str | None:
        """Under ``auto``: why every call on ``device`` runs eagerly (decided once per device), or None."""
        if self.ep_size > 1:
            return "ep > 1 (the all-to-all changes the rows every step)"
        try:
            acc = accelerator_for(device)
        except PolyaccelError:
            return f"no device graphs on {device.type}"
        if not acc.has("graphs"):
            return f"no device graphs on {getattr(acc, 'name', device.type)}"
        return None

    def _within_budget(self, acc, device: torch.device) -> bool:
        """Under ``auto``: whether one more capture is allowed (see :data:`AUTO_POOL_BUDGET_FRACTION`)."""
        if not acc.has("memory_stats"):
            return len(self.entries) < AUTO_SHAPES_UNMEASURED
        return held_bytes(device) < AUTO_POOL_BUDGET_FRACTION * acc.total_memory(device.index)

    @staticmethod
    def _eager_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
        if not torch.is_grad_enabled():
            return "grad mode off"
        if torch.is_autocast_enabled(x.device.type):
            return "autocast"
        if x.numel() == 0:
            return "no tokens"
        return None

    def _hooked(self) -> list[str]:
        return [n or "(experts)" for n, m in self.experts.named_modules() if m._forward_pre_hooks or m._forward_hooks]

    def _refuse_hooks(self) -> None:
        hooked = self._hooked()
        if hooked:
            raise PolyaccelError(
                f"capture_graphs: {self.name}'s expert module(s) {', '.join(hooked)} have forward hooks, which a graph "
                "replay would skip (ZeRO stage 3 gathers the experts' parameters in such hooks). Use ZeRO stage 1 or "
                "2 with capture_graphs, or set capture_graphs to false")

    def _static_inputs(self, x, weights, idx, rows: int) -> tuple[torch.Tensor, ...]:
        """Copies of the inputs (outside capture: never in the pool), ``rows`` long: pad rows after the call's."""
        n, k = idx.shape
        if rows == n:
            return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in (x, weights)) + (idx.clone(),)
        sx = x.new_zeros((rows, *x.shape[1:]))
        sw = weights.new_zeros((rows, *weights.shape[1:]))
        sidx = torch.arange(k, device=idx.device, dtype=idx.dtype).expand(rows, k).clone()
        sx[:n], sw[:n], sidx[:n] = x.detach(), weights.detach(), idx
        return sx.requires_grad_(x.requires_grad), sw.requires_grad_(weights.requires_grad), sidx

    def _capture(self, acc, x, weights, idx, params, rows: int) -> _Captured:
        acc.require("graphs", "set expert_parallel.capture_graphs to false: this backend has no device graphs")
        static = self._static_inputs(x, weights, idx, rows)
        trained = [p for p in params if p.requires_grad]
        wanted = [t for t in (*static[:2], *trained) if t.requires_grad]
        entry = _Captured(acc=acc, inputs=static, params=params, param_ptrs=tuple(p.data_ptr() for p in params),
                          trained=tuple(trained), fn=self.fn, count=_weak(self._count), rows=rows, filled=x.shape[0],
                          pad_ids=torch.arange(idx.shape[1], device=idx.device, dtype=idx.dtype))
        measured = acc.has("memory_stats")
        try:
            with _own_saved_tensors(), _side_stream(acc):
                for _ in range(WARMUP_RUNS):
                    out, _ = self.fn(*static)
                    torch.autograd.grad(out, wanted, grad_outputs=torch.ones_like(out), allow_unused=True)
                del out
            entry.grad_out = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
            before = acc.memory_reserved(x.device.index) if measured else 0
            entry.fwd = acc.create_graph()
            with _own_saved_tensors(), acc.capture_to_graph(entry.fwd, pool=self.pool):
                entry.out, entry.extras = self.fn(*static)
            if self.pool is None and hasattr(entry.fwd, "pool"):
                self.pool = entry.fwd.pool()
            entry.bwd = acc.create_graph()
            with _own_saved_tensors(), acc.capture_to_graph(entry.bwd, pool=self.pool):
                got = torch.autograd.grad(entry.out, wanted, grad_outputs=entry.grad_out, allow_unused=True)
            entry.held = acc.memory_reserved(x.device.index) - before if measured else 0
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
