"""The npu plugin: Huawei Ascend NPUs through torch_npu (CANN).

hccl collectives, ``torch.npu.NPUGraph`` device graphs, host-buffer registration through
``torch.npu.npurt().npuHostRegister`` (ACL_HOST_REG_MAPPED, 4096-byte aligned), and
npu op builders (torch's fused Adam, foreach Lion/Lamb, an npu_quantize quantizer).
torch_npu is imported when the plugin is probed, never at ``import polyaccel``.
"""

from polyaccel.hookspecs import EMULATED_MARKER, hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import NpuAccelerator

    return [NpuAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_comm_hooks(accelerator):
    if getattr(accelerator, "name", None) != "npu":
        return None
    from polyaccel.comm.hooks import CommHooks

    # HCCL binds a communicator to the current device, like NCCL: pass device_id
    return CommHooks(backend="hccl", pass_device_id=True)


@hookimpl
def polyaccel_report(accelerator):
    from . import runtime

    mod, reason = runtime.import_torch_npu()
    if mod is None:
        if reason.startswith("torch_npu is not installed"):
            return None  # nothing to say beyond the plugin's status line
        return {"runtime": reason, "hint": runtime.AUTOLOAD_HINT}
    facts = {"torch_npu": getattr(mod, "__version__", "unknown"),
             "emulated": getattr(mod, EMULATED_MARKER, False) is True}
    binding, why = runtime.npurt_binding()
    facts["host_register"] = "npuHostRegister (ACL_HOST_REG_MAPPED, 4096-byte aligned)" if binding else why
    facts["graphs"] = "torch.npu.NPUGraph" if hasattr(runtime.npu_module(), "NPUGraph") else "not in this torch_npu"
    return facts


@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import NpuRuntime

    return [NpuRuntime]
