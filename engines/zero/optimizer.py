"""The optimizer step on a rank's flat fp32 partition, through the op registry.

The step runs on the device where the partition lives (the accelerator, or ``cpu`` when the
optimizer is offloaded) with the op builder the registry picks for that device type:
``fused_adam`` (adam, adamw), ``fused_lion`` and ``fused_lamb``.

LAMB needs one thing a partition-local op cannot know: its trust ratio is per *parameter*,
and a parameter's elements are spread over several ranks. So the engine asks ``fused_lamb``
for the moment update and the Adam direction only (applied to a zero scratch tensor with
``lr=1`` and the trust ratio pinned to 1, which yields ``-m_hat/(sqrt(v_hat)+eps)``
exactly), then all-reduces per-parameter squared norms of the weights and the update and
applies ``-lr * trust * update`` itself. The result equals single-process LAMB.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from polyaccel import ops
from polyaccel.ops.reference.optimizers import lamb_trust_ratio

from .config import OptimizerConfig
from .split_partition import ranges

_OP_FOR = {"adam": "fused_adam", "adamw": "fused_adam", "lion": "fused_lion", "lamb": "fused_lamb",
           "muon": "fused_adam"}  # muon: its auxiliary Adam (the matrices are in .muon)
STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",),
               "lamb": ("exp_avg", "exp_avg_sq"), "muon": ("exp_avg", "exp_avg_sq")}


class PartitionOptimizer:
    """Optimizer state and step for one flat partition (``master``) of ``P`` elements."""

    def __init__(self, cfg: OptimizerConfig, master: torch.Tensor, alloc: Callable[[int, torch.dtype], torch.Tensor],
                 segment_ids: Callable[[], torch.Tensor] | None = None, num_segments: int = 0,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 decay_runs: list[tuple[int, int, float]] | None = None):
        """``decay_runs``: ``(lo, hi, weight decay)`` runs covering the partition in order (see
        :mod:`.weight_decay`); None: ``cfg.weight_decay`` everywhere."""
        self.cfg = cfg
        runs = list(decay_runs) if decay_runs else []
        if runs and (runs[0][0] != 0 or runs[-1][1] != master.numel()
                     or any(a[1] != b[0] for a, b in zip(runs, runs[1:], strict=False))):
            raise ValueError(f"decay runs must cover the partition of {master.numel()} elements in order")
        decays = {wd for _, _, wd in runs}
        #: the weight decay of every element when they share one, else None (then :attr:`decay_runs` says)
        self.uniform_decay = decays.pop() if len(decays) == 1 else (cfg.weight_decay if not decays else None)
        self.decay_runs = runs if self.uniform_decay is None else [(0, master.numel(), self.uniform_decay)]
        self._plans: dict[tuple[int, int], list[tuple[float, list[tuple[int, int]]]]] = {}
        self.lr = cfg.lr
        self.master = master
        self.op = _OP_FOR[cfg.type]
        self.state: dict[str, torch.Tensor] = {}
        for name in STATE_NAMES[cfg.type]:
            buf = alloc(master.numel(), master.dtype)
            buf.zero_()
            self.state[name] = buf
        self.step_count = 0
        self._num_segments = num_segments
        self._all_reduce = all_reduce
        self._segments = None  # LAMB's parameter index per element (8 bytes each), built only for LAMB
        if cfg.type == "lamb":
            if segment_ids is None or all_reduce is None:
                raise ValueError("lamb needs segment ids and an all-reduce for its per-parameter trust ratio")
            self._segments = segment_ids().to(master.device)

    def release(self) -> None:
        """Drop the state and the master reference (the engine is being destroyed)."""
        self.state.clear()
        self.master = None

    @property
    def builder_name(self) -> str:
        """Name of the op builder the registry chose for this partition's device type."""
        device_type = self.master.device.type
        ops.resolve(self.op, device_type)
        return ops.registry.chosen(self.op, device_type).name

    def state_elements(self) -> int:
        return sum(t.numel() for t in self.state.values())

    @property
    def steps_in_slices(self) -> bool:
        """Whether a step may be applied slice by slice (element-wise optimizers; LAMB's trust ratio is not)."""
        return self.cfg.type != "lamb"

    #: whether :meth:`step_slice` only prepares a slice and :meth:`finish_step` applies the step once every
    #: slice is prepared (an optimizer of whole matrices, Muon); the slices are uploaded after that
    defers_apply = False

    def finish_step(self, partitioner=None) -> None:
        """Apply a step whose slices :meth:`step_slice` prepared (see :attr:`defers_apply`), uploading
        ``partitioner``'s chunks as they are done; else nothing."""

    def slice_done(self, lo: int, hi: int) -> bool:
        """Whether elements ``[lo, hi)`` are fully stepped by :meth:`step_slice` (then uploaded at once)."""
        return not self.defers_apply

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self.begin_step()
        if self.cfg.type == "lamb":
            self._lamb_step(grad)
        else:
            self.step_slice(grad, 0, self.master.numel())

    def begin_step(self) -> None:
        """Start one optimizer step; :meth:`step_slice` then applies it to parts of the partition."""
        self.step_count += 1

    def _plan(self, lo: int, hi: int) -> list[tuple[float, list[tuple[int, int]]]]:
        """``[lo, hi)`` cut at the decay runs, the pieces grouped by weight decay (cached per slice: the
        engine steps the same slices every step)."""
        plan = self._plans.get((lo, hi))
        if plan is None:
            by_decay: dict[float, list[tuple[int, int]]] = {}
            starts = [r[0] for r in self.decay_runs]
            k = max(0, bisect.bisect_right(starts, lo) - 1)
            while k < len(self.decay_runs) and self.decay_runs[k][0] < hi:
                a, b, wd = self.decay_runs[k]
                if min(b, hi) > max(a, lo):
                    by_decay.setdefault(wd, []).append((max(a, lo), min(b, hi)))
                k += 1
            plan = self._plans[(lo, hi)] = list(by_decay.items())
        return plan

    @torch.no_grad()
    def step_slice(self, grad: torch.Tensor, lo: int, hi: int) -> None:
        """Apply the step begun by :meth:`begin_step` to elements ``[lo, hi)`` of the partition: one op call
        per weight decay in the slice (one call without parameter groups)."""
        if not self.steps_in_slices:
            raise RuntimeError("lamb steps the whole partition at once")
        for a, b in ranges(self.master, lo, hi):  # one op call per place a split partition is kept
            if self.uniform_decay is not None:
                self._step_pieces(grad, [(a, b)], self.uniform_decay)
                continue
            for wd, pieces in self._plan(a, b):
                self._step_pieces(grad, pieces, wd)

    def _step_pieces(self, grad: torch.Tensor, pieces: list[tuple[int, int]], weight_decay: float) -> None:
        c = self.cfg
        m = [self.master[a:b] for a, b in pieces]
        g = [grad[a:b] for a, b in pieces]
        m1 = [self.state["exp_avg"][a:b] for a, b in pieces]
        if c.type in ("adam", "adamw"):
            m2 = [self.state["exp_avg_sq"][a:b] for a, b in pieces]
            ops.fused_adam(m, g, m1, m2, lr=self.lr, beta1=c.betas[0], beta2=c.betas[1], eps=c.eps,
                           weight_decay=weight_decay, step=self.step_count, adam_w_mode=c.adam_w_mode,
                           bias_correction=c.bias_correction)
        else:
            ops.fused_lion(m, g, m1, lr=self.lr, beta1=c.betas[0], beta2=c.betas[1], weight_decay=weight_decay)

    def _lamb_step(self, grad: torch.Tensor) -> None:
        c = self.cfg
        m = self.master
        direction = torch.zeros_like(m)
        ops.fused_lamb([direction], [grad], [self.state["exp_avg"]], [self.state["exp_avg_sq"]], lr=1.0,
                       beta1=c.betas[0], beta2=c.betas[1], eps=c.eps, weight_decay=0.0, step=self.step_count,
                       bias_correction=c.bias_correction, max_coeff=1.0, min_coeff=1.0)
        update = direction.neg_()
        for lo, hi, wd in self.decay_runs:  # LAMB's decay joins the update before the trust ratio
            if wd:
                update[lo:hi].add_(m[lo:hi], alpha=wd)
        n = self._num_segments
        sq = torch.zeros(2, n + 1, dtype=torch.float64, device=m.device)
        sq[0].index_add_(0, self._segments, m.double().square())
        sq[1].index_add_(0, self._segments, update.double().square())
        sq = self._all_reduce(sq)
        trust = lamb_trust_ratio(sq[0, :n].sqrt(), sq[1, :n].sqrt(), c.min_coeff, c.max_coeff)
        trust = torch.cat([trust, trust.new_ones(1)]).to(m.dtype)
        m.add_(update * trust[self._segments], alpha=-self.lr)
