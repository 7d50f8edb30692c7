"""The ``sequence_parallel`` config section: ``{"autosp_size": S, "seq_dim": 1}``."""

from __future__ import annotations

from dataclasses import dataclass

from polyaccel.errors import ConfigError

SECTION = "sequence_parallel"
KEYS = ("autosp_size", "seq_dim")
#: the mesh dimension the section sets and the key that sets it (named in mesh errors)
SIZE_KEYS = {"sequence": "autosp_size"}


@dataclass(frozen=True)
class SPConfig:
    autosp_size: int
    seq_dim: int = 1


def _int(where: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where} must be an int >= {low}, got {value!r}")
    return value


def parse(section, where: str = SECTION) -> SPConfig:
    """Validate a section (not modified) into an :class:`SPConfig`."""
    if isinstance(section, SPConfig):
        return section
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a dict with keys {list(KEYS)}, got {type(section).__name__}")
    unknown = sorted(str(k) for k in section if k not in KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed keys: {list(KEYS)}")
    if "autosp_size" not in section:
        raise ConfigError(f"{where}.autosp_size is required: the number of ranks that share each sequence "
                          "(1 turns sequence parallelism off)")
    size = _int(f"{where}.autosp_size", section["autosp_size"], 1)
    seq_dim = _int(f"{where}.seq_dim", section.get("seq_dim", 1), 0)
    if seq_dim != 1:
        raise ConfigError(f"{where}.seq_dim {seq_dim}: Hugging Face decoders keep the sequence at dim 1 of "
                          "[batch, seq] (and [batch, seq, hidden]); only seq_dim 1 is supported")
    return SPConfig(size, seq_dim)
