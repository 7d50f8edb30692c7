"""The ``sequence_parallel`` config section: ``{"autosp_size": S, "seq_dim": 1}``."""

from __future__ import annotations

from dataclasses import dataclass

from polyaccel.config_check import Int, Section

SECTION = "sequence_parallel"
KEYS = ("autosp_size", "seq_dim")
#: the mesh dimension the section sets and the key that sets it (named in mesh errors)
SIZE_KEYS = {"sequence": "autosp_size"}


@dataclass(frozen=True)
class SPConfig:
    autosp_size: int
    seq_dim: int = 1


def parse(section, where: str = SECTION) -> SPConfig:
    """Validate a section (not modified) into an :class:`SPConfig`."""
    if isinstance(section, SPConfig):
        return section
    sec = Section(section, where, KEYS)
    size = sec.require("autosp_size", "the number of ranks that share each sequence (1 turns sequence "
                       "parallelism off)", Int(1))
    seq_dim = sec.get("seq_dim", Int(0), 1)
    if seq_dim != 1:
        raise sec.error("seq_dim", f"is {seq_dim}: Hugging Face decoders keep the sequence at dim 1 of "
                        "[batch, seq] (and [batch, seq, hidden]); only seq_dim 1 is supported")
    return SPConfig(size, seq_dim)
