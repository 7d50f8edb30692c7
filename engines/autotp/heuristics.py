"""The base plan of a model without a plan of its own (GPT-2's ``Conv1D`` blocks, say): DeepSpeed's
name and structure rule, per parent module."""

from __future__ import annotations

from torch import nn

from .model_facts import ATTN_PARENTS, GATE_UP, QKV_CONCAT, QKV_INTERLEAVED, ROW_NAMES, SKIP_NAMES, join
from .plan_objects import COLUMN, ROW, SKIP, VOCAB_EMBED, VOCAB_HEAD
from .rule import Rule

_LINEAR_KINDS = ("linear", "conv1d")
_MOE_PARENTS = ("mlp", "block_sparse_moe", "moe", "feed_forward")


def heuristic_rules(root: nn.Module, kinds: dict[str, str], out_emb: str | None,
                    inp_emb: str | None) -> dict[str, Rule]:
    """DeepSpeed's structure rule: per parent, row if named like an output projection or the last
    linear before a norm, fused names split per sub-weight, routers/gates skipped, the rest column.
    A parent's linears are split only when it has both a column and a row (else its output would
    stay split); the vocabulary layers are split on the vocabulary."""
    rules: dict[str, Rule] = {}
    for pname, parent in root.named_modules():
        proposed = _proposed_rules(pname, list(parent.named_children()), kinds, out_emb)
        if not proposed:
            continue
        styles = {r.style for r in proposed.values()}
        if COLUMN in styles and ROW in styles:
            rules.update(proposed)
        else:
            rules.update({k: Rule(SKIP, "heuristic", "no column/row pair in its parent: left whole")
                          for k in proposed})
    if out_emb is not None:
        rules[out_emb] = Rule(VOCAB_HEAD, "heuristic", "lm_head: vocab")
    if inp_emb is not None:
        rules[inp_emb] = Rule(VOCAB_EMBED, "heuristic", "input embedding: vocab")
    return rules


def _proposed_rules(pname: str, children: list[tuple[str, nn.Module]], kinds: dict[str, str],
                    out_emb: str | None) -> dict[str, Rule]:
    """The rule each linear child of one parent would get (the lm_head aside)."""
    pshort = pname.split(".")[-1]
    proposed: dict[str, Rule] = {}
    for i, (n, _c) in enumerate(children):
        full = join(pname, n)
        if kinds.get(full) not in _LINEAR_KINDS or full == out_emb:
            continue
        nxt = children[i + 1][1] if i + 1 < len(children) else None
        before_norm = nxt is not None and "norm" in type(nxt).__name__.lower()
        proposed[full] = _child_rule(n, pshort, before_norm)
    return proposed


def _child_rule(n: str, pshort: str, before_norm: bool) -> Rule:
    """The rule of linear child ``n`` of a parent named ``pshort`` (``before_norm``: a norm follows it)."""
    if n in SKIP_NAMES or (n == "gate" and pshort in _MOE_PARENTS):
        return Rule(SKIP, "heuristic", "router/gate: left whole")
    if n in QKV_CONCAT or n in QKV_INTERLEAVED:
        return Rule(COLUMN, "heuristic", "fused qkv: column per sub-weight")
    if n in GATE_UP:
        return Rule(COLUMN, "heuristic", "packed gate/up: column per half", 2)
    if n in ROW_NAMES or (n == "dense" and pshort in ATTN_PARENTS) or before_norm:
        return Rule(ROW, "heuristic", "output projection: row")
    return Rule(COLUMN, "heuristic", "column")
