"""The supa plugin: Biren GPUs through torch_supa.

Detected through torch_supa itself, before anything CUDA-like (torch_supa also answers as
``torch.cuda``); bccl collectives; ``torch.supa.SUPAGraph`` device graphs; host-buffer
registration through ``torch.supa.supart()``; fused optimizers through the kernels
torch_supa_ext registers, with the reference as fallback. torch_supa is imported when the
plugin is probed, never at ``import polyaccel``.
"""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import SupaAccelerator

    return [SupaAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()

@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import SupaRuntime

    return [SupaRuntime]
