"""The npu plugin: Huawei Ascend NPUs through torch_npu (CANN).

hccl collectives, ``torch.npu.NPUGraph`` device graphs, host-buffer registration through
``torch.npu.npurt().npuHostRegister`` (ACL_HOST_REG_MAPPED, 4096-byte aligned), and
npu op builders (torch's fused Adam, foreach Lion/Lamb, an npu_quantize quantizer).
torch_npu is imported when the plugin is probed, never at ``import polyaccel``.
"""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import NpuAccelerator

    return [NpuAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()

@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import NpuRuntime

    return [NpuRuntime]
