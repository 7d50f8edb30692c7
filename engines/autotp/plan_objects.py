"""The tensor-parallel plan as data: the internal split styles and the plan of a module, an attention
module and a whole model (with its table and JSON views). No model is inspected here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# internal styles
COLUMN = "column"  # output features split, output stays split (feeds a row layer or attention)
COLUMN_GATHER = "column_gather"  # output features split, output gathered to full
ROW = "row"  # input features split, input arrives split, output all-reduced
ROW_SPLIT = "row_split_input"  # input features split, input arrives whole and is sliced
VOCAB_EMBED = "vocab_embedding"  # embedding rows (vocabulary) split, masked lookup + all-reduce
VOCAB_HEAD = "vocab_head"  # lm_head rows (vocabulary) split; logits gathered, or kept split for the loss
GRAD_SUM = "grad_sum"  # left whole, gradients partial over the tensor group (summed)
SKIP = "skip"

SPLIT_STYLES = (COLUMN, COLUMN_GATHER, ROW, ROW_SPLIT, VOCAB_EMBED, VOCAB_HEAD)

#: Hugging Face plan styles AutoTP runs, and what they become
HF_STYLES = {
    "colwise": COLUMN,
    "packed_colwise": COLUMN,  # [gate | up] packed: two sub-weights
    "colwise_gather_output": COLUMN_GATHER,
    "colwise_rep": COLUMN_GATHER,
    "rowwise": ROW,
    "rowwise_split_input": ROW_SPLIT,
    "rowwise_rep": ROW_SPLIT,
    "embedding_rowwise": VOCAB_EMBED,
    "replicated_with_grad_allreduce": GRAD_SUM,
}


@dataclass(frozen=True)
class ModulePlan:
    """How one module is split. ``sections[j][r]``: rank r's size of sub-weight j along the split dim."""

    name: str
    style: str
    kind: str  # linear, conv1d, embedding, module
    sections: tuple[tuple[int, ...], ...] = ()
    source: str = ""  # partition_config, preset:<name>, hf_plan, heuristic, tied
    rule: str = ""  # the style or rule text it came from
    tied_with: str | None = None
    sub_names: tuple[str, ...] = ()  # names of the sub-weights (q, k, v / gate, up), for display

    def local(self, rank: int) -> int:
        return sum(s[rank] for s in self.sections)

    @property
    def full(self) -> int:
        return sum(sum(s) for s in self.sections)

    def weight_axis(self) -> int:
        """The dim of the module's stored ``weight`` that is split."""
        if self.style in (VOCAB_EMBED, VOCAB_HEAD):
            return 0
        column = self.style in (COLUMN, COLUMN_GATHER)
        if self.kind == "conv1d":  # weight stored [in, out]
            return 1 if column else 0
        return 0 if column else 1


@dataclass(frozen=True)
class AttentionPlan:
    """Heads each rank keeps in one attention module (whole KV heads, each with its query group)."""

    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    out_proj: str
    #: one all-reduce of the input gradient for all of q/k/v, at the module's input (Hugging Face
    #: attention, whose input feeds only the projections); else one per projection
    shared_input: bool = False

    @property
    def zero_head_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.kv_heads) if n == 0)


@dataclass
class TPPlan:
    tp: int
    source: str
    modules: dict[str, ModulePlan] = field(default_factory=dict)
    attention: dict[str, AttentionPlan] = field(default_factory=dict)
    grad_sum: tuple[str, ...] = ()  # parameter names: whole, gradient summed over the tensor group
    replicated: tuple[str, ...] = ()  # parameter names left whole (no split, complete gradients)
    #: parameters another layer placed before AutoTP (AutoEP's experts): left whole over tensor, layout kept
    placed: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    vocab_size: int | None = None

    def counts(self) -> dict[str, int]:
        c = {"column": 0, "row": 0, "vocab": 0, "replicated": len(self.replicated) + len(self.grad_sum)}
        for m in self.modules.values():
            if m.style in (COLUMN, COLUMN_GATHER):
                c["column"] += 1
            elif m.style in (ROW, ROW_SPLIT):
                c["row"] += 1
            elif m.style in (VOCAB_EMBED, VOCAB_HEAD):
                c["vocab"] += 1
        return c

    def rows(self) -> list[tuple[str, str, str, list[int]]]:
        """(module, style, source, per-rank shard sizes) for every split or grad-summed module."""
        out = []
        for m in self.modules.values():
            if m.style in SPLIT_STYLES:
                out.append((m.name, m.style, m.source, [m.local(r) for r in range(self.tp)]))
        return out

    def to_dict(self) -> dict:
        return {
            "tp": self.tp, "source": self.source, "counts": self.counts(), "vocab_size": self.vocab_size,
            "modules": {n: {"style": m.style, "kind": m.kind, "source": m.source, "rule": m.rule,
                            "sections": [list(s) for s in m.sections], "sub_names": list(m.sub_names),
                            "per_rank": [m.local(r) for r in range(self.tp)], "tied_with": m.tied_with}
                        for n, m in self.modules.items() if m.style != SKIP},
            "attention": {n: {"head_dim": a.head_dim, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
                              "q_heads": list(a.q_heads), "kv_heads": list(a.kv_heads), "out_proj": a.out_proj}
                          for n, a in self.attention.items()},
            "grad_sum": list(self.grad_sum), "replicated": list(self.replicated), "placed": list(self.placed),
            "notes": list(self.notes),
        }

    def format(self, compact: bool = True) -> str:
        """A readable table; ``compact`` folds modules that differ only in their layer number."""
        lines = [f"tensor-parallel plan: tp={self.tp}, rules from {self.source}"]
        groups: dict[tuple, list[str]] = {}
        for m in self.modules.values():
            if m.style == SKIP:
                continue
            key_name = re.sub(r"\.\d+\.", ".*.", m.name) if compact else m.name
            sizes = " | ".join(_fmt_sizes(m, r) for r in range(self.tp)) if m.style != GRAD_SUM else "whole"
            key = (key_name, m.style, m.source, sizes, m.tied_with and re.sub(r"\.\d+\.", ".*.", m.tied_with))
            groups.setdefault(key, []).append(m.name)
        width = max([len(k[0]) for k in groups] + [6])
        lines.append(f"  {'module':<{width}}  {'style':<16} {'from':<18} per-rank shard (rank 0 | 1 | ...)")
        for (name, style, source, sizes, tied), members in groups.items():
            n = f" x{len(members)}" if len(members) > 1 else ""
            tie = f"  (shares its weight with {tied})" if tied else ""
            lines.append(f"  {name:<{width}}  {style:<16} {source:<18} {sizes}{n}{tie}")
        if self.attention:
            heads: dict[tuple, int] = {}
            for a in self.attention.values():
                k = (a.num_heads, a.num_kv_heads, a.head_dim, a.q_heads, a.kv_heads)
                heads[k] = heads.get(k, 0) + 1
            for (nh, nkv, hd, q, kv), n in heads.items():
                lines.append(f"  attention x{n}: {nh} heads / {nkv} KV heads of {hd} -> per rank "
                             f"q {list(q)}, kv {list(kv)}")
        c = self.counts()
        lines.append(f"  counts: {c['column']} column, {c['row']} row, {c['vocab']} vocab, "
                     f"{c['replicated']} replicated parameters ({len(self.grad_sum)} with grads summed over "
                     "the tensor group)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt_sizes(m: ModulePlan, rank: int) -> str:
    if len(m.sections) == 1:
        return str(m.sections[0][rank])
    names = m.sub_names or tuple(str(i) for i in range(len(m.sections)))
    return "+".join(f"{n}{s[rank]}" for n, s in zip(names, m.sections, strict=True))


__all__ = [
    "COLUMN", "COLUMN_GATHER", "GRAD_SUM", "HF_STYLES", "ROW", "ROW_SPLIT", "SKIP", "SPLIT_STYLES", "VOCAB_EMBED",
    "VOCAB_HEAD", "AttentionPlan", "ModulePlan", "TPPlan",
]
