"""The uneven shard rule AutoTP uses everywhere (weights, heads, vocabulary).

``n`` things over ``tp`` ranks: every rank gets ``n // tp`` and the first ``n % tp`` ranks one
more. Ten rows over four ranks are ``[3, 3, 2, 2]``, not ``torch.chunk``'s ``[3, 3, 3, 1]``.
Attention is cut on whole key/value heads (each one carrying its group of query heads), so six
KV heads over four ranks are 2/2/1/1 heads, and two KV heads over four ranks leave two ranks
with none (those ranks contribute zeros to the output projection's all-reduce).
"""

from __future__ import annotations

from polyaccel.errors import ConfigError


def shard_sizes(total: int, tp: int, unit: int = 1) -> tuple[int, ...]:
    """Sizes of ``tp`` shards of ``total`` elements cut on whole units of ``unit`` elements.

    >>> shard_sizes(10, 4)
    (3, 3, 2, 2)
    >>> shard_sizes(6 * 8, 4, unit=8)   # six heads of 8 over 4 ranks
    (16, 16, 8, 8)
    """
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"the tensor-parallel degree must be a positive int, got {tp!r}")
    if unit < 1 or total < 0:
        raise ConfigError(f"cannot shard {total} elements in units of {unit}")
    if total % unit:
        raise ConfigError(f"{total} elements are not a whole number of units of {unit}")
    units = total // unit
    base, extra = divmod(units, tp)
    return tuple((base + (1 if r < extra else 0)) * unit for r in range(tp))


def offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Start of each shard: the running sum of the sizes before it."""
    out, start = [], 0
    for s in sizes:
        out.append(start)
        start += s
    return tuple(out)


__all__ = ["offsets", "shard_sizes"]
