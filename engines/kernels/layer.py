"""The ``kernels`` model layer that ``polyaccel.initialize`` applies (entry-point group ``polyaccel.layers``).

It applies last (``ORDER`` 30, after AutoEP's 10 and AutoTP's 20): the modules it swaps keep calling
their own submodules, so AutoTP's split linears, AutoEP's expert blocks and the lm_head AutoTP split over
the vocabulary are what the kernels' forwards run on. It needs no mesh dimension of its own."""

from __future__ import annotations

from .apply import apply_kernels
from .config import expand, parse

ORDER = 30


def expand_section(value) -> dict:
    """``"auto"``, ``true`` or ``false`` as the dict form (see :mod:`.config`)."""
    return expand(value)


def mesh_sizes(section: dict) -> dict:
    parse(section)
    return {}


def apply(model, section: dict, mesh):
    return apply_kernels(model, section, mesh)
