"""The xpu plugin: Intel GPUs through native torch.xpu, xccl (or oneCCL's ccl), torch's fused Adam.

intel-extension-for-pytorch is optional and used only when it matches the running torch.
"""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import XpuAccelerator

    return [XpuAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()

@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import XpuRuntime

    return [XpuRuntime]
