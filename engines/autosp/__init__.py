"""AutoSP: sequence parallelism (Ulysses attention) for Hugging Face models, the ``sequence_parallel`` layer.

Each rank of a sequence group holds a contiguous ``1/S`` of every sequence of the same batch rows
(:func:`polyaccel.sequence.split_batch` cuts a batch that way). Attention is the only place tokens
meet: there one all-to-all turns ``[seq/S, heads]`` into ``[seq, heads/S]`` and one turns it back
(:mod:`.attention`). See docs/autosp.md.
"""

from __future__ import annotations

from .all_to_all import heads_to_seq, seq_to_heads
from .apply import PLAN_ATTR, apply_sequence_parallel, plan_sequence_parallel
from .config import SPConfig, parse
from .detect import SPPlan, check_heads

__all__ = ["PLAN_ATTR", "SPConfig", "SPPlan", "apply_sequence_parallel", "check_heads", "heads_to_seq", "parse",
           "plan_sequence_parallel", "seq_to_heads"]
