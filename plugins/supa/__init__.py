"""The supa plugin: Biren GPUs through torch_supa.

Detected through torch_supa itself, before anything CUDA-like (torch_supa also answers as
``torch.cuda``); bccl collectives; ``torch.supa.SUPAGraph`` device graphs; host-buffer
registration through ``torch.supa.supart()``; fused optimizers through the kernels
torch_supa_ext registers, with the reference as fallback. torch_supa is imported when the
plugin is probed, never at ``import polyaccel``.
"""

from polyaccel.hookspecs import EMULATED_MARKER, hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import SupaAccelerator

    return [SupaAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_comm_hooks(accelerator):
    if getattr(accelerator, "name", None) != "supa":
        return None
    from polyaccel.comm.hooks import CommHooks

    return CommHooks(backend=accelerator.communication_backend, pass_device_id=True)


@hookimpl
def polyaccel_report(accelerator):
    from . import runtime

    mod, reason = runtime.import_torch_supa()
    if mod is None:
        return None if reason.startswith("torch_supa is not installed") else {"runtime": reason}
    binding, why = runtime.supart_binding()
    ops = runtime.deepspeed_ops()
    kernels = [k for k in ("multi_tensor_adam", "multi_tensor_lion", "lamb") if hasattr(ops, k)] if ops else []
    return {
        "torch_supa": getattr(mod, "__version__", "unknown"),
        "emulated": getattr(mod, EMULATED_MARKER, False) is True,
        "host_register": "supaHostRegister" if binding else why,
        "torch_supa_ext kernels": kernels or "torch_supa_ext not installed: optimizers use the reference",
    }


@hookimpl
def polyaccel_emulated_runtimes():
    from .emulation import SupaRuntime

    return [SupaRuntime]
