"""The cuda plugin: NVIDIA GPUs through torch.cuda, NCCL, CUDA graphs, cudaHostRegister, Triton ops."""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import CudaAccelerator

    return [CudaAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()
