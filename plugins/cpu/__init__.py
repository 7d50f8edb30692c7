"""The cpu plugin: the embedded default backend (gloo, synchronized, no streams or graphs)."""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import CpuAccelerator

    return [CpuAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()
