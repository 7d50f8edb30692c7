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
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_comm_hooks(accelerator):
    """xccl (or oneCCL's ccl) reads XPU tensors directly: no staging; no backend is a clear error."""
    if getattr(accelerator, "name", None) != "xpu":
        return None
    from polyaccel.comm import CommHooks
    from polyaccel.errors import ConfigError

    choice = accelerator.comm_choice()
    if choice.backend is None:
        raise ConfigError(choice.reason)
    return CommHooks(backend=choice.backend)


@hookimpl
def polyaccel_report(accelerator):
    from .accelerator import XpuAccelerator
    from .ipex import inspect_ipex

    if isinstance(accelerator, XpuAccelerator):
        return accelerator.report()
    verdict = inspect_ipex()
    if verdict.installed:
        return verdict.report_facts()
    return None


@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import XpuRuntime

    return [XpuRuntime]
