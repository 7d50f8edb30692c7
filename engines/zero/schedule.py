"""Stage 3's schedule check: the ranks agree on every parameter gather, or every rank stops at once.

Every gather is preceded by one small all-gather of a row per rank, ``(first parameter, number of
parameters, shard elements, ready buckets)``. Rows that differ mean a module ran on some ranks and not
on others; every rank sees every row, so every rank raises the same :class:`ScheduleMismatch` before
the mismatched gather could hang. The end of each forward and of each backward is a row too (a
marker in place of the parameter), so a rank that has no further gather meets its peers' next
gather and fails with them, instead of leaving them waiting for a peer that will never gather.

The last column carries the rank's count of gradient buckets complete in a prefix (see
:class:`~.bucket_order.BucketOrder`): after each agreement every rank reduces the buckets complete on
*every* rank, so the reduce-scatters of backward fall between the same gathers everywhere, however
the local gradients arrived (an expert that got no token here produces no gradient here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .leaves import ScheduleMismatch

END_FORWARD = -1
END_BACKWARD = -2
_WIDTH = 4
_ENDS = {END_FORWARD: "forward", END_BACKWARD: "backward"}
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


class GatherSchedule:
    """One process group's agreement on gathers.

    ``owner(order)`` is the path of the module whose hooks gather the parameter at position ``order``
    and ``param_name(order)`` its name; ``model`` resolves paths into modules for the suggested fix.
    """

    def __init__(self, coll, device: torch.device, model: torch.nn.Module, owner: Callable[[int], str],
                 param_name: Callable[[int], str]):
        self.coll, self.device, self.model = coll, device, model
        self.owner, self.param_name = owner, param_name

    def agree(self, row: tuple[int, int, int], ready: int, compare: bool = True) -> int:
        """Exchange ``row`` (or an end marker: ``(END_FORWARD, 0, 0)``) and the ready-bucket count; raise
        :class:`ScheduleMismatch` on every rank if the rows differ (``compare``); return the smallest count."""
        key = torch.tensor([*row, ready], dtype=torch.int64, device=self.device)
        out = torch.empty(_WIDTH * self.coll.world, dtype=torch.int64, device=self.device)
        self.coll.all_gather(out, key)
        table = out.view(self.coll.world, _WIDTH).tolist()
        rows = [tuple(r[:3]) for r in table]
        if compare and any(r != rows[0] for r in rows):
            raise ScheduleMismatch(self.message(rows))
        return min(r[3] for r in table)

    def message(self, rows: list[tuple[int, int, int]]) -> str:
        """What each rank was about to do and the fix (the same text on every rank: it depends on the rows)."""
        by_row: dict[tuple, list[int]] = {}
        for rank, row in enumerate(rows):
            by_row.setdefault(row, []).append(rank)
        what = []
        for row, ranks in by_row.items():
            if row[0] in _ENDS:
                what.append(f"rank(s) {ranks} reached the end of {_ENDS[row[0]]} with nothing left to gather")
            else:
                what.append(f"rank(s) {ranks} gather module {self.owner(row[0])!r} ({self.param_name(row[0])})")
        gathered = sorted({self.owner(row[0]) for row in by_row if row[0] not in _ENDS})
        return (f"ZeRO stage 3: the ranks disagree about which parameters to gather next ({'; '.join(what)}). "
                "A module ran on some ranks and not on others (data-dependent control flow, such as MoE experts "
                "that run only where tokens are routed), so the parameter gathers no longer line up. "
                f"Fix: {self._fix(gathered)}")

    def _fix(self, paths: list[str]) -> str:
        enclosing = self.enclosing(paths)
        how = "polyaccel.engines.zero.set_leaf_modules(model, [...])"
        if enclosing:
            cls = type(self._module(enclosing)).__name__
            return ("mark the module that always runs around the conditional part as a leaf, whose whole subtree "
                    f"is gathered at once: zero_optimization.stage3_leaf_modules=[{enclosing!r}] (or its class "
                    f"[{cls!r}], for every module of that class) or {how}.")
        return ("the module runs on some ranks only and nothing but the model itself encloses it: make it run on "
                "every rank (its output multiplied by zero where it is not wanted), or mark a module that always "
                f"runs around it as a leaf with zero_optimization.stage3_leaf_modules=[...] or {how} "
                f"(the model itself, {type(self.model).__name__!r}, gathers every parameter at once).")

    def enclosing(self, paths: list[str]) -> str:
        """The innermost module that encloses the disagreeing modules and is not itself one of several
        alternatives: their common ancestor (the parent, for one module), moved up past containers
        (``ModuleList``/``ModuleDict``: never called themselves) and past elements of containers (one
        expert of many). ``""`` is the model itself."""
        if not paths:
            return ""
        parts = [p.split(".") if p else [] for p in paths]
        common = []
        for names in zip(*parts, strict=False):
            if any(n != names[0] for n in names):
                break
            common.append(names[0])
        if len(paths) == 1 or len(common) == min(len(p) for p in parts):  # one module: what encloses it
            common = common[:-1]
        while common:
            module = self._module(".".join(common))
            parent = self._module(".".join(common[:-1]))
            if not isinstance(module, _CONTAINERS) and not isinstance(parent, _CONTAINERS):
                break
            common = common[:-1]
        return ".".join(common)

    def _module(self, path: str) -> torch.nn.Module:
        return self.model.get_submodule(path) if path else self.model
