"""The mps plugin: Apple GPUs through torch.mps; gloo with host staging; a Metal FusedAdam kernel."""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import MpsAccelerator

    return [MpsAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_comm_hooks(accelerator):
    """gloo cannot read MPS tensors: every tensor goes through host staging (async copy back in wait())."""
    if getattr(accelerator, "name", None) != "mps":
        return None
    from polyaccel.comm import CommHooks

    return CommHooks(backend="gloo", supports_device_tensors=False)


@hookimpl
def polyaccel_report(accelerator):
    if getattr(accelerator, "name", None) == "mps":
        return accelerator.report()
    return None


@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import MpsRuntime

    return [MpsRuntime]
