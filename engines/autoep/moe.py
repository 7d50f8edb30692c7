"""The expert-parallel MoE block that replaces a detected HF block.

Per forward: the block's own router (kept, so transformers' output recorders still see its logits) picks
top-k experts; the assignments are sorted expert-major, exchanged over the expert group by all-to-all
(ep > 1), run through the local experts as ``grouped_mm`` -> ``swiglu`` -> ``grouped_mm`` from the op
registry (or the plugin's fused expert ops, or one dense MLP when every token goes to every expert), brought
home and combined per token. Dropless; no collective at ep 1. An expert's local gradient already sums its
EP group's tokens, so ZeRO sums it over ``expert_data`` as it sums a dense one over ``data``.
The steps, the fused and dense paths, graphs and gradients: docs/autoep.md.
"""

from __future__ import annotations

import torch
from polyaccel import ops
from polyaccel.errors import InvalidArgument
from polyaccel.ops import offsets as known_offsets
from polyaccel.ops.reference.swiglu import halves_of

from .detect import MoELayerSpec
from .dispatch import AllToAllV, exchange_counts
from .graphed import GraphedRoute
from .permute import DispatchRows, PermuteRows, inverse_permutation
from .presets import Routing
from .router_logits import router_logits

#: logit dtypes for which ``route`` takes a renormalised top-k softmax as the softmax of the top-k logits
SHORT_ROUTE_DTYPES = (torch.bfloat16, torch.float16)
#: rows above which torch sorts on an accelerator by radix passes over the key's bits (at or below it, one
#: in-block sort whatever the key's width): there the expert ids are sorted as int16 (2 passes instead of 8)
RADIX_SORT_ROWS = 4096


def route(logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E].

    Mirrors transformers' routers: scores in float32; softmax or sigmoid; the correction bias and
    group limits change which experts are chosen, never the weights; optional renormalisation
    (sigmoid scores get DeepSeek's 1e-20 guard) and scaling.

    A renormalised softmax over the top k is the softmax of the k largest logits (the full
    softmax's denominator cancels). For 16-bit logits that case takes the top k of the logits and
    a softmax over k columns: the same experts, and weights that differ from the longer formula
    by float32 rounding (far below the logits' own), with 3 kernels forward and 4 backward instead
    of 5 and 11, which is what a layer with few tokens a step, bound by the host's launches, pays
    for. Wider logits keep transformers' order of operations, so fp32 and fp64 models match it
    to their own precision.
    """
    s = logits.float()
    if (logits.dtype in SHORT_ROUTE_DTYPES and r.score_func == "softmax" and r.route_norm and bias is None
            and not r.num_groups):
        top, idx = torch.topk(s, r.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        return (weights * r.scale if r.scale != 1.0 else weights), idx
    scores = torch.softmax(s, dim=-1) if r.score_func == "softmax" else torch.sigmoid(s)
    if bias is None and not r.num_groups:
        weights, idx = torch.topk(scores, r.top_k, dim=-1)
    else:
        choice = scores + bias.float() if bias is not None else scores
        if r.num_groups:
            T, E = choice.shape
            grouped = choice.view(T, r.num_groups, E // r.num_groups)
            if r.group_score == "top2_sum":
                gscore = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                gscore = grouped.amax(dim=-1)
            gidx = torch.topk(gscore, k=r.limited_groups, dim=-1, sorted=False)[1]
            gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1)
            smask = gmask.unsqueeze(-1).expand(T, r.num_groups, E // r.num_groups).reshape(T, E)
            choice = choice.masked_fill(~smask.bool(), float("-inf"))
        idx = torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
    if r.route_norm:
        denom = weights.sum(dim=-1, keepdim=True)
        if r.score_func == "sigmoid":
            denom = denom + 1e-20
        weights = weights / denom
    if r.scale != 1.0:
        weights = weights * r.scale
    return weights, idx


class GroupedExperts(torch.nn.Module):
    """This rank's experts as transformers-5 fused 3-D parameters (same names and orientation).

    ``gate_up_proj`` [E_local, 2F, H] (gate rows first, then up) and ``down_proj``
    [E_local, H, F]; with ``transposed``, [E_local, H, 2F] and [E_local, F, H].
    ``first_expert`` is the global index of local expert 0.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, *, transposed: bool, first_expert: int,
                 num_experts: int, requires_grad: bool = True):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=requires_grad)
        self.down_proj = torch.nn.Parameter(down, requires_grad=requires_grad)
        self.transposed = transposed
        self.first_expert = first_expert
        self.num_experts = num_experts  # global count
        self.num_local_experts = gate_up.shape[0]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [E_local, H, 2F], w2 [E_local, F, H]) in grouped_mm's [experts, in, out] orientation (views)."""
        gu, down = self.gate_up_proj, self.down_proj
        if self.transposed:
            return gu, down
        return gu.transpose(1, 2), down.transpose(1, 2)

    def forward(self, x: torch.Tensor, ends: torch.Tensor | None, index: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``x`` sorted by local expert, local expert e's ending at row ``ends[e]`` (int64, cumulative:
        the offsets ``grouped_mm`` takes).

        With ``index`` ([tokens, k], as ``gather_sum`` takes it), ``x`` holds the token rows
        instead and the result is each token's k slots summed with ``weights``: the fused
        expert ops (:func:`run_fused_experts`). With ``weights`` alone ([tokens, E_local]),
        ``x`` holds the token rows, every token goes to every expert and the result is their
        weighted sum (:func:`run_dense_experts`; ``ends`` is not read).

        Called on every rank in every forward (with no rows too), so hooks that gather the
        parameters around a module's forward (ZeRO stage 3) see the same calls everywhere.
        """
        w1, w2 = self.weights()
        if index is not None:
            return run_fused_experts(x, index, w1, w2, ends, weights)
        if weights is not None:
            return run_dense_experts(x, w1, w2, weights)
        return run_experts(x, w1, w2, ends)

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return f"experts {self.first_expert}-{last} of {self.num_experts}, transposed={self.transposed}"


class GateUpHalves(torch.autograd.Function):
    """``h.chunk(2, -1)`` (gate, up), whose backward hands back the two gradients without a copy when the
    swiglu builder wrote them as the halves of one tensor (the Triton one does); else it concatenates them."""

    @staticmethod
    def forward(ctx, h: torch.Tensor):
        return h.chunk(2, dim=-1)

    @staticmethod
    def backward(ctx, d_gate: torch.Tensor, d_up: torch.Tensor):  # (an unused half's gradient arrives as zeros)
        whole = halves_of(d_gate, d_up)
        return whole if whole is not None else torch.cat((d_gate, d_up), dim=-1)


def run_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows sorted by local expert: grouped_mm -> swiglu -> grouped_mm."""
    gate, up = GateUpHalves.apply(ops.grouped_mm(x, w1, offsets))
    return ops.grouped_mm(ops.swiglu(gate, up), w2, offsets)


def run_fused_experts(x: torch.Tensor, index: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The same experts on token rows ``x`` dispatched by ``index`` and combined with ``weights``:
    ``moe_gate_up`` -> ``moe_down_combine`` (``gather_sum(run_experts(x dispatched), index, weights)``)."""
    return ops.moe_down_combine(ops.moe_gate_up(x, index, w1, offsets), w2, offsets, index, weights)


def run_dense_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, summed with ``weights`` [T, E]: ``sum_e weights[:, e] * expert_e(x)``.

    The gate/up projection of all experts is one ``[T, H] x [H, E*2F]`` product and the down
    projection one ``[T, E*F] x [E*F, H]`` product (its inner dimension sums over the experts);
    ``weighted_swiglu`` applies the router weights to the hidden rows in between. ``w1`` and ``w2``
    are in grouped_mm's orientation; a layout that cannot be viewed that way is copied (the
    weights, not the activations).
    """
    T, H = x.shape
    E, _, F2 = w1.shape
    gu = x @ w1.permute(1, 0, 2).reshape(H, E * F2)  # [T, E*2F]: expert e's gate and up at columns e*2F...
    gate, up = GateUpHalves.apply(gu.view(T * E, F2))
    h = ops.weighted_swiglu(gate, up, weights.reshape(T * E))
    return h.view(T, E * (F2 // 2)) @ w2.reshape(E * (F2 // 2), H)


def counts_of(ends: torch.Tensor) -> torch.Tensor:
    """Rows per expert from the experts' cumulative end rows."""
    return ends - torch.nn.functional.pad(ends[:-1], (1, 0))


class DispatchRecord(dict):
    """What a forward dispatched, detached: ``counts`` (rows this rank routed to each global expert),
    ``received`` (rows each local expert computed), ``send`` / ``recv`` (rows to and from each peer; None
    at ep 1).

    At ep 1 the forward records only the experts' end rows (``ends``); ``counts`` and ``received`` are
    derived from them when first read (``record["counts"]``), so a step nobody inspects launches
    nothing for them.
    """

    def __missing__(self, key):
        if key in ("counts", "received") and "ends" in self:
            counts = counts_of(self["ends"])
            self["counts"] = self["received"] = counts
            return counts
        raise KeyError(key)


def fused_experts_provided(device_type: str) -> bool:
    """Whether the plugin serving ``device_type`` provides both fused expert ops (not just their reference)."""
    return ops.provides("moe_gate_up", device_type) and ops.provides("moe_down_combine", device_type)


class AutoEPMoE(torch.nn.Module):
    """A MoE block with its experts placed over the expert-parallel group (see the module docstring)."""

    def __init__(self, spec: MoELayerSpec, router: torch.nn.Module, experts: GroupedExperts,
                 shared: torch.nn.Module | None, shared_gate: torch.nn.Module | None, *,
                 group=None, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        self.spec = spec
        self.routing = spec.routing
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.group = group
        self.num_experts = spec.num_experts
        self.jitter_noise = spec.jitter_noise
        self.add_module(spec.router_name, router)
        self.add_module(spec.experts_name, experts)
        if shared is not None:
            self.add_module(spec.shared_name, shared)
        if shared_gate is not None:
            self.add_module(spec.shared_gate_name, shared_gate)
        #: what the last forward dispatched (for tests and monitoring; see :class:`DispatchRecord`)
        self.last_dispatch: DispatchRecord | None = None
        #: the fused expert ops: None = where the device's plugin provides them, True/False = always/never
        self.fused_experts: bool | None = None
        #: every token to every expert as one dense MLP (see the module docstring); False keeps the routed path
        self.dense_when_all_chosen = True
        #: replay the routed experts from device graphs: True (ep 1), False, or "auto" (where they pay; see
        #: :mod:`.graphed`)
        self.capture_graphs: bool | str = "auto"
        self._graphs: GraphedRoute | None = None
        self._pad_counts: dict[tuple, torch.Tensor] = {}  # per (top_k, device): 1 for experts 0..k-1 (pad rows)
        self._expert_id_cache: dict[torch.dtype, torch.Tensor] = {}
        self._row_id_cache: torch.Tensor | None = None
        self._graphed_call = False  # within a call of the graphed route (see _captured_route)
        #: False: always call the router module for the logits (see :mod:`.router_logits`)
        self._linear_router = True

    @property
    def router(self) -> torch.nn.Module:
        return getattr(self, self.spec.router_name)

    @property
    def local_experts(self) -> GroupedExperts:
        return getattr(self, self.spec.experts_name)

    def extra_repr(self) -> str:
        return f"ep {self.ep_rank}/{self.ep_size}, {self.routing.describe()}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits = router_logits(self.router, x, self._linear_router)
        if logits.shape[-1] != self.num_experts:
            raise InvalidArgument(f"{self.spec.name or 'AutoEP layer'}: the router gives {logits.shape[-1]} scores a "
                                  f"token for {self.num_experts} experts")
        bias = getattr(self.router, "e_score_correction_bias", None) if self.routing.correction_bias else None
        weights, idx = route(logits, self.routing, bias)
        y = self._routed(x, weights, idx)
        if self.spec.shared_name is not None:
            s = getattr(self, self.spec.shared_name)(x)
            if self.spec.shared_gate_name is not None:
                s = torch.sigmoid(getattr(self, self.spec.shared_gate_name)(x)) * s
            y = y + s
        y = y.reshape(-1, shape[-1]) if self.spec.flat_output else y.reshape(shape)
        if self.spec.returns_router_logits:
            return y, logits
        return y

    def _uses_fused(self, x: torch.Tensor) -> bool:
        if self.routing.score_apply == "pre" or self.fused_experts is False:
            return False
        return self.fused_experts or fused_experts_provided(x.device.type)

    def _uses_dense(self, k: int) -> bool:
        return (self.dense_when_all_chosen and self.fused_experts is not True and k == self.num_experts
                and self.ep_size == 1 and self.routing.score_apply == "post")

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        auto = self.capture_graphs == "auto"
        if auto or (self.capture_graphs and self.ep_size == 1):
            graphs = self._graphs
            if graphs is None or graphs.auto != auto or graphs.experts is not self.local_experts:
                graphs = self._graphs = GraphedRoute(self._captured_route, self.local_experts,
                                                     self.spec.name or "AutoEP layer", auto=auto, ep_size=self.ep_size)
            replayed = graphs(x, weights, idx)
            if replayed is not None:
                y, extras, pad = replayed
                counts = extras["counts"]
                counts = torch.sub(counts, self._pad_unit(idx.shape[1], counts), alpha=pad) if pad else counts.clone()
                self.last_dispatch = DispatchRecord(counts=counts, received=counts, send=None, recv=None)
                return y
        return self._routed_eagerly(x, weights, idx)

    def _pad_unit(self, k: int, counts: torch.Tensor) -> torch.Tensor:
        """What one pad row of the graphed route adds to the expert counts: 1 for experts 0..k-1 (its ids)."""
        unit = self._pad_counts.get((k, counts.device))
        if unit is None:
            unit = self._pad_counts[(k, counts.device)] = (torch.arange(counts.numel(), device=counts.device) < k
                                                           ).to(counts.dtype)
        return unit

    def _captured_route(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
        """What :class:`.graphed.GraphedRoute` captures: the eager route, and the expert counts it reports (with
        nothing kept between calls in its graphs' reads: a kept tensor replaced for another shape would be freed
        under a graph still reading it)."""
        self._graphed_call = True
        before = self.last_dispatch  # (the caller records what a call dispatched: warm-up, capture and a
        try:  # backward's recompute run padded inputs, whose counts include the pad rows)
            y = self._routed_eagerly(x, weights, idx)
            counts = self.last_dispatch["counts"]
        finally:
            self._graphed_call = False
            self.last_dispatch = before
        return y, {"counts": counts}

    def _expert_ids(self, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``arange(E)`` on ``device`` in ``dtype``, made once per dtype (the values ``_sorted_routes`` searches
        for; a graph captured with one keeps reading it, so it is not replaced while the device stays)."""
        ids = self._expert_id_cache.get(dtype)
        if ids is None or ids.device != device:
            ids = self._expert_id_cache[dtype] = torch.arange(self.num_experts, device=device, dtype=dtype)
        return ids

    def _row_ids(self, n: int, device: torch.device) -> torch.Tensor:
        """``arange(n)`` on ``device``, kept for the next step of the same size (``inverse_permutation``'s values)."""
        if self._graphed_call:
            return torch.arange(n, device=device)
        ids = self._row_id_cache
        if ids is None or ids.numel() != n or ids.device != device:
            ids = self._row_id_cache = torch.arange(n, device=device)
        return ids

    def _sorted_routes(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order, inverse, ends) of the T*k assignments ``idx``: ``order`` sorts them expert-major (stable: within
        an expert, token order), ``inverse`` is its inverse and ``ends[e]`` the end row of global expert e in that
        order, found in the sorted ids (one search; no sync with the host, as bincount's would be).

        The ids are ``topk`` picks among the router's E scores, so every row has an expert and the end rows are
        valid by construction: they are marked so (the expert ops then skip reading them back to check).

        Above :data:`RADIX_SORT_ROWS` rows the ids are sorted as int16 (exact for fewer than 2**15 experts: the
        same order), so an accelerator's radix sort makes 2 passes over their bits instead of 8."""
        ids = idx.reshape(-1)
        if ids.numel() > RADIX_SORT_ROWS and self.num_experts < 2**15:
            ids = ids.to(torch.int16)
        expert_of_row, order = torch.sort(ids, stable=True)
        ends = torch.searchsorted(expert_of_row, self._expert_ids(idx.device, ids.dtype), right=True)
        inverse = inverse_permutation(order, self._row_ids(order.numel(), order.device))
        return order, inverse, known_offsets.mark_complete(ends, idx.numel())

    def _exchange(self, ends: torch.Tensor):
        """ep > 1: the counts this rank sends each expert, exchanged: (counts, received per local expert, the
        received per [source rank][local expert], rows sent to each peer, rows received from each)."""
        counts = counts_of(ends)
        recv, send_rows, recv_rows = exchange_counts(counts, self.ep_size, self.group)
        return counts, recv.sum(0), recv, send_rows, recv_rows

    def _local_order(self, x: torch.Tensor, recv: torch.Tensor, rows: int) -> torch.Tensor:
        """The permutation that sorts received rows ([source rank][local expert] order) by local expert."""
        n_local = self.num_experts // self.ep_size
        local_ids = torch.arange(n_local, device=x.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(local_ids, recv.reshape(-1), output_size=rows)
        return torch.argsort(row_expert, stable=True)

    def _routed_eagerly(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        T, k = idx.shape
        E = self.num_experts
        if self._uses_dense(k):
            counts = torch.full((E,), T, dtype=torch.int64, device=x.device)
            self.last_dispatch = DispatchRecord(counts=counts, received=counts, send=None, recv=None)
            w = weights.to(x.dtype)
            per_expert = w.new_zeros(T, E).scatter(1, idx, w)
            return self.local_experts(x, None, None, per_expert)
        order, inverse, ends = self._sorted_routes(idx)
        # (the weights stay float32 after the experts: the combine weights and sums its rows in float32, as
        # transformers' blocks multiply the experts' rows by float32 weights)
        if self._uses_fused(x):
            return self._routed_fused(x, weights, order, inverse.view(T, k), ends)
        routed = DispatchRows.apply(x, order, inverse, k)
        if self.routing.score_apply == "pre":
            routed = routed * weights.to(x.dtype).reshape(-1).index_select(0, order).unsqueeze(-1)
        experts = self.local_experts
        if self.ep_size == 1:
            y = experts(routed, ends)
            self.last_dispatch = DispatchRecord(ends=ends, send=None, recv=None)  # (int: no gradient to detach)
        else:
            counts, received_counts, recv, send_rows, recv_rows = self._exchange(ends)
            received = AllToAllV.apply(routed, recv_rows, send_rows, self.group)  # [source][local expert] order
            perm = self._local_order(x, recv, sum(recv_rows))
            back = inverse_permutation(perm)
            y_local = experts(PermuteRows.apply(received, perm, back), torch.cumsum(received_counts, 0))
            y = AllToAllV.apply(PermuteRows.apply(y_local, back, perm), send_rows, recv_rows, self.group)
            self.last_dispatch = DispatchRecord(counts=counts.detach(), received=received_counts.detach(),
                                                send=send_rows, recv=recv_rows)
        post = weights if self.routing.score_apply == "post" else None
        return ops.gather_sum(y, inverse.view(T, k), post)  # back to tokens, summed over their k slots

    def _routed_fused(self, x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, index: torch.Tensor,
                      ends: torch.Tensor) -> torch.Tensor:
        """``_routed`` through the fused expert ops (``score_apply == "post"``; see the module docstring)."""
        experts = self.local_experts
        if self.ep_size == 1:
            self.last_dispatch = DispatchRecord(ends=ends, send=None, recv=None)  # (int: no gradient to detach)
            return experts(x, ends, index, weights)
        # the rows leave in expert order: this dispatch is the one gather outside the experts
        routed = DispatchRows.apply(x, order, index.reshape(-1), index.shape[1])
        counts, received_counts, recv, send_rows, recv_rows = self._exchange(ends)
        received = AllToAllV.apply(routed, recv_rows, send_rows, self.group)  # [source][local expert] order
        back = inverse_permutation(self._local_order(x, recv, sum(recv_rows))).view(-1, 1)
        y_back = experts(received, torch.cumsum(received_counts, 0), back, None)  # in received order again
        y = AllToAllV.apply(y_back, send_rows, recv_rows, self.group)
        self.last_dispatch = DispatchRecord(counts=counts.detach(), received=received_counts.detach(),
                                            send=send_rows, recv=recv_rows)
        return ops.gather_sum(y, index, weights)
