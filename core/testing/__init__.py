"""Testing kit for polyaccel and for plugin authors.

- ``polyaccel.testing.multiprocess``: spawn N ranks (gloo on CPU) with a timeout.
- ``polyaccel.testing.conformance``: the per-backend conformance suite (a pytest plugin).
- ``polyaccel.testing.emulation``: CPU-backed stand-ins for vendor runtimes.
- ``polyaccel.testing.numerics``: compare against the reference op in float64.
"""
