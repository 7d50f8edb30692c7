"""The mps plugin: Apple GPUs through torch.mps; gloo with host staging; a Metal FusedAdam kernel."""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import MpsAccelerator

    return [MpsAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()


@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import MpsRuntime

    return [MpsRuntime]
