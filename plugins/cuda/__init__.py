"""The cuda plugin: NVIDIA GPUs through torch.cuda, NCCL, CUDA graphs, cudaHostRegister, Triton ops."""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import CudaAccelerator

    return [CudaAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_comm_hooks(accelerator):
    from .accelerator import CudaAccelerator

    if type(accelerator) is not CudaAccelerator:
        return None
    from .comm import comm_hooks

    return comm_hooks(accelerator)


@hookimpl
def polyaccel_report(accelerator):
    from .accelerator import CudaAccelerator
    from .report import report

    if type(accelerator) is not CudaAccelerator:
        return None
    return report(accelerator)
