"""Per-rank sizes of every module with a rule: attention on whole heads (each KV head with its query
group), the other column/row pairs by the uneven rule, with the sizes of a pair made to agree; the
modules next to split layers are checked (a per-head norm sums its gradient, the rest are refused)."""

from __future__ import annotations

from polyaccel.errors import ConfigError

from .model_facts import (
    GATE_UP,
    HEAD_NORMS,
    KV_NAMES,
    Q_NAMES,
    QKV_CONCAT,
    QKV_INTERLEAVED,
    ModelView,
    features,
    head_counts,
    is_hf_attention,
    join,
)
from .plan_objects import (
    COLUMN,
    COLUMN_GATHER,
    GRAD_SUM,
    ROW,
    ROW_SPLIT,
    SKIP,
    VOCAB_EMBED,
    VOCAB_HEAD,
    AttentionPlan,
    ModulePlan,
    TPPlan,
)
from .rule import Rule
from .shard import shard_sizes

_ATTENTION_NAMES = Q_NAMES | KV_NAMES | QKV_CONCAT | QKV_INTERLEAVED


def size_modules(view: ModelView, resolved: dict[str, Rule], rules: dict[str, Rule], plan: TPPlan,
                 tied: bool) -> None:
    """Fill ``plan.modules`` and ``plan.attention``; every problem found is raised together."""
    sizer = _ModuleSizer(view, resolved, rules, plan, tied)
    for pname, names in sizer.parent_groups():
        sizer.size_parent(pname, names)
    if sizer.errors:
        raise ConfigError("tensor_parallel: " + "; ".join(sizer.errors))


def sub_sections(name, fout, sub, tp, errors):
    """Per-rank sizes of each sub-weight of a fused output (``sub``: a count of equal ones, or their sizes)
    and the sub-weights' display names; (None, ()) with an error appended when they do not fit."""
    if sub is None:
        return [shard_sizes(fout, tp)], ()
    sizes = (fout // sub,) * sub if isinstance(sub, int) else tuple(sub)
    if isinstance(sub, int) and fout % sub:
        errors.append(f"{name}: {fout} output features do not split into {sub} equal sub-weights")
        return None, ()
    if sum(sizes) != fout:
        errors.append(f"{name}: sub-weight sizes {list(sizes)} add up to {sum(sizes)}, not its {fout} output features")
        return None, ()
    names = ("gate", "up") if len(sizes) == 2 else ("q", "k", "v") if len(sizes) == 3 else ()
    return [shard_sizes(s, tp) for s in sizes], names


def _short(name: str) -> str:
    return name.rpartition(".")[2]


class _ModuleSizer:
    """Works out the sizes parent by parent (the column and row layers of one parent form a pair),
    collecting every error."""

    def __init__(self, view: ModelView, resolved: dict[str, Rule], rules: dict[str, Rule], plan: TPPlan,
                 tied: bool):
        self.view, self.resolved, self.rules, self.plan, self.tied = view, resolved, rules, plan, tied
        self.tp = plan.tp
        self.errors: list[str] = []

    def parent_groups(self) -> list[tuple[str, list[str]]]:
        """(parent name, its children with rules), in the model's module order."""
        by_parent: dict[str, list[str]] = {}
        for name in self.resolved:
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
        order = {n: i for i, n in enumerate(self.view.modules)}
        return [(p, sorted(by_parent[p], key=lambda n: order[n]))
                for p in sorted(by_parent, key=lambda p: order.get(p, -1))]

    def add(self, name, style, sections, rule: Rule, sub_names=(), tied_with=None) -> None:
        self.plan.modules[name] = ModulePlan(name, style, self.view.kinds.get(name, "module"),
                                             tuple(tuple(s) for s in sections), rule.source, rule.rule, tied_with,
                                             tuple(sub_names))

    def features(self, name: str) -> tuple[int, int]:
        return features(self.view.modules[name], self.view.kinds[name])

    # -------------------------------------------------------------------------------------------- one parent
    def size_parent(self, pname: str, names: list[str]) -> None:
        parent = self.view.modules.get(pname)
        local_cols = [n for n in names if self.resolved[n].style == COLUMN]
        rows = [n for n in names if self.resolved[n].style == ROW]
        error = _pairing_error(pname, local_cols, rows)
        if error is not None:
            self.errors.append(error)
            return
        row = rows[0] if rows else None
        if any(_short(n) in _ATTENTION_NAMES for n in local_cols):
            if not self.size_attention(pname, parent, local_cols, row):
                return
        elif row is not None:
            self.size_pair(pname, parent, local_cols, row)
        for n in names:
            if n not in local_cols and n != row:
                self.size_single(n, parent)

    def size_attention(self, pname: str, parent, local_cols: list[str], row: str) -> bool:
        """q/k/v and the output projection of one attention module, on whole heads; False on an error."""
        heads = self._splittable_heads(pname, parent, row)
        if heads is None:
            return False
        n_heads, n_kv, hd = heads
        kv = shard_sizes(n_kv, self.tp)
        q = tuple(k * (n_heads // n_kv) for k in kv)
        ok = True
        for n in local_cols:
            sized = self._projection_sections(n, heads, q, kv)
            if sized is None:
                ok = False
                continue
            self.add(n, COLUMN, sized[0], self.resolved[n], sized[1])
        fin, _ = self.features(row)
        if fin != n_heads * hd:
            self.errors.append(f"{row}: {fin} input features, but the attention's {n_heads} heads of {hd} give "
                               f"{n_heads * hd}")
            ok = False
        if not ok:
            return False
        self.add(row, ROW, [[x * hd for x in q]], self.resolved[row])
        self.plan.attention[pname] = AttentionPlan(pname, hd, n_heads, n_kv, q, kv, row, is_hf_attention(parent))
        self.check_siblings(pname, parent, head_dim=hd, attention=True)
        return True

    def _splittable_heads(self, pname: str, parent, row: str) -> tuple[int, int, int] | None:
        """(heads, KV heads, head dim) of an attention module AutoTP can split; None with an error if not."""
        heads = head_counts(parent, self.view.hf_cfg)
        if heads is None:
            self.errors.append(f"attention {pname!r}: its head counts are unknown (no num_attention_heads / head_dim "
                               "on the module or the model config), so q/k/v cannot be split on whole heads")
            return None
        n_heads, n_kv, _hd = heads
        if n_heads % n_kv:
            self.errors.append(f"attention {pname!r}: {n_heads} heads are not a multiple of {n_kv} KV heads")
            return None
        kv = shard_sizes(n_kv, self.tp)
        if getattr(parent, "is_cross_attention", False):
            self.errors.append(f"attention {pname!r} is cross-attention; AutoTP splits self-attention only (mark its "
                               "projections skip)")
            return None
        if 0 in kv and not (is_hf_attention(parent) and row is not None):
            self.errors.append(f"autotp_size {self.tp} is more than the {n_kv} KV heads of {pname!r} "
                               f"({type(parent).__name__}): ranks would hold no heads, and AutoTP runs such ranks "
                               "only for Hugging Face attention modules")
            return None
        return heads

    def _projection_sections(self, n: str, heads, q, kv):
        """(sections, sub-weight names) of projection ``n`` of an attention module; None with an error when
        its output does not fit the heads."""
        n_heads, n_kv, hd = heads
        group = n_heads // n_kv
        _, fout = self.features(n)
        r, s = self.resolved[n], _short(n)
        if s in QKV_INTERLEAVED and r.sub_params is None:
            want, secs, subn = n_kv * (group + 2) * hd, [[k * (group + 2) * hd for k in kv]], ()
        elif s in QKV_CONCAT or (r.sub_params is not None):
            sizes = (n_heads * hd, n_kv * hd, n_kv * hd)
            if r.sub_params is not None and r.sub_params not in (3, sizes):
                self.errors.append(f"{n}: its rule's shape {r.sub_params!r} does not match the attention's "
                                   f"[q | k | v] sizes {list(sizes)} ({n_heads} heads, {n_kv} KV heads of {hd})")
                return None
            want = sum(sizes)
            secs = [[x * hd for x in q], [x * hd for x in kv], [x * hd for x in kv]]
            subn = ("q", "k", "v")
        elif s in Q_NAMES:
            want, secs, subn = n_heads * hd, [[x * hd for x in q]], ()
        else:
            want, secs, subn = n_kv * hd, [[x * hd for x in kv]], ()
        if fout != want:
            self.errors.append(f"{n}: {fout} output features, but {n_heads} heads / {n_kv} KV heads of {hd} "
                               f"need {want}")
            return None
        return secs, subn

    def size_pair(self, pname: str, parent, local_cols: list[str], row: str) -> None:
        """A row layer and the column layers feeding it (not attention): the columns' sizes must be the row's."""
        fin, _ = self.features(row)
        rsec = shard_sizes(fin, self.tp)
        self.add(row, ROW, [rsec], self.resolved[row])
        for n in local_cols:
            _, fout = self.features(n)
            secs, subn = sub_sections(n, fout, self.resolved[n].sub_params, self.tp, self.errors)
            if secs is None:
                continue
            mismatch = next((sec for sec in secs if tuple(sec) != rsec), None)
            if mismatch is not None:
                self.errors.append(f"{n} gives the ranks {list(mismatch)} features but {row} expects "
                                   f"{list(rsec)}; their split sizes must agree")
            else:
                self.add(n, COLUMN, secs, self.resolved[n], subn)
        self.check_siblings(pname, parent, head_dim=None, attention=False)

    def size_single(self, n: str, parent) -> None:
        """A module split on its own: gathered column, row over a whole input, vocabulary, or grad-summed."""
        r = self.resolved[n]
        if r.style == GRAD_SUM:
            if n not in self.plan.modules:
                self.add(n, GRAD_SUM, [], r)
        elif r.style == COLUMN_GATHER:
            _, fout = self.features(n)
            secs, subn = sub_sections(n, fout, self._gathered_sub_params(n, parent, fout), self.tp, self.errors)
            if secs is not None:
                self.add(n, COLUMN_GATHER, secs, r, subn)
        elif r.style == ROW_SPLIT:
            fin, _ = self.features(n)
            self.add(n, ROW_SPLIT, [shard_sizes(fin, self.tp)], r)
        elif r.style in (VOCAB_EMBED, VOCAB_HEAD):
            vocab = self.view.modules[n].weight.shape[0]
            inp, out = self.view.inp_emb, self.view.out_emb
            tied_with = (out if n == inp else inp) if self.tied else None
            self.add(n, r.style, [shard_sizes(vocab, self.tp)], r, tied_with=tied_with)

    def _gathered_sub_params(self, n: str, parent, fout: int):
        """The sub-weights of a gathered column layer: its rule's, else [q | k | v] or [gate | up] by its name."""
        sub = self.resolved[n].sub_params
        if sub is None and _short(n) in QKV_CONCAT:
            heads = head_counts(parent, self.view.hf_cfg)
            if heads is not None and (heads[0] + 2 * heads[1]) * heads[2] == fout:
                sub = (heads[0] * heads[2], heads[1] * heads[2], heads[1] * heads[2])
        if sub is None and _short(n) in GATE_UP:
            sub = 2
        return sub

    def check_siblings(self, pname: str, parent, head_dim, attention) -> None:
        """Parameters next to split layers see split activations: per-head norms get grad_sum, others are
        refused."""
        for pn, _p in parent.named_parameters(recurse=False):
            self.errors.append(f"{pname}.{pn} is a parameter of {pname}, whose layers are split, and AutoTP cannot "
                               f"tell how to split it; mark {pname}'s layers skip")
        for cn, child in parent.named_children():
            full = join(pname, cn)
            if full in self.resolved and self.resolved[full].style != GRAD_SUM:
                continue
            own = list(child.named_parameters())
            if not own:
                continue
            r = self.rules.get(full)
            if r is not None and r.style == SKIP and r.source == "partition_config":
                continue  # the user says it sees whole activations
            if full in self.resolved:  # grad_sum by rule
                res = self.resolved[full]
                self.plan.modules[full] = ModulePlan(full, GRAD_SUM, "module", (), res.source, res.rule)
                continue
            if attention and cn in HEAD_NORMS and all(p.numel() == head_dim for _, p in own):
                self.plan.modules[full] = ModulePlan(full, GRAD_SUM, "module", (), "heuristic",
                                                     "per-head norm: gradient summed over the tensor group")
                continue
            self.errors.append(f"{full} ({type(child).__name__}) sits between the split layers of {pname} and has "
                               "parameters AutoTP cannot split; mark it replicated_with_grad_allreduce if it acts on "
                               "each rank's share alone (like a per-head norm), or skip if it sees whole activations")


def _pairing_error(pname: str, local_cols: list[str], rows: list[str]) -> str | None:
    """A parent's column layers with a split output need exactly one row layer to take it, and back."""
    if local_cols and not rows:
        return (f"{', '.join(local_cols)} in {pname or 'the model'} are column-parallel with a split output, "
                "but no row-parallel layer in the same module takes it; make one row-parallel, or use "
                "colwise_gather_output / gather_output")
    if rows and not local_cols:
        return (f"{', '.join(rows)} in {pname or 'the model'} are row-parallel over a split input, but no "
                "column-parallel layer in the same module splits it; use rowwise_split_input, or make "
                "the producer column-parallel")
    if len(rows) > 1:
        return (f"{pname} has several row-parallel layers ({', '.join(rows)}); AutoTP pairs one row "
                "layer with the column layers of a module")
    return None
