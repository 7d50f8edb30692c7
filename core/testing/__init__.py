"""Testing kit for polyaccel and for plugin authors.

- ``polyaccel.testing.multiprocess``: spawn N ranks (gloo on CPU) with a timeout.
- ``polyaccel.testing.conformance``: the per-backend conformance suite (a pytest plugin).
- ``polyaccel.testing.emulation``: the kit for CPU-backed stand-ins of vendor runtimes (plugins ship their own).
- ``polyaccel.testing.numerics``: compare against the reference op in float64.
- ``polyaccel.testing.launches``: count the kernels code launches, at the dispatcher (host-bound steps).
"""
