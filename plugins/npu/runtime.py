"""Find the Ascend runtime (torch_npu on CANN) and say in words why it is not usable.

Detection asks the runtime (:class:`polyaccel.vendor_extension.VendorExtension`), never the
mere presence of the package: an installed torch_npu whose CANN libraries are missing fails
at import with ``ImportError: libhccl.so: cannot open shared object file``; that is
"unavailable" with the reason. Nothing here runs at ``import polyaccel`` time; it runs when
the plugin is probed.
"""

from __future__ import annotations

from typing import Any

from polyaccel.vendor_extension import VendorExtension

#: ACL host-registration flags (acl_rt.h). MAPPED maps the pages for device DMA and needs a
#: 4096-byte aligned address and length; PINNED-only registration measured far slower H2D.
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000
HOST_REGISTER_ALIGNMENT = 4096
#: ACL return codes (acl_base.h) the runtime answers host registration with
ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000

AUTOLOAD_HINT = (
    "if `import torch` itself fails with 'Failed to load the backend extension: torch_npu', set "
    "TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or uninstall torch-npu on hosts without CANN)"
)


#: the Ascend extension: torch_npu installs torch.npu
TORCH_NPU = VendorExtension(
    module="torch_npu", torch_attr="npu", install_hint="on an Ascend host with CANN: pip install polyaccel[npu]",
    libraries="the CANN libraries are missing or not on LD_LIBRARY_PATH (source CANN's set_env.sh)",
    device="NPU", visible_devices_env="ASCEND_RT_VISIBLE_DEVICES", hint=AUTOLOAD_HINT)


def npurt_binding() -> tuple[Any | None, str]:
    """(torch.npu.npurt() binding, "") or (None, why host registration is unavailable)."""
    return TORCH_NPU.runtime_binding(
        "npurt", ("npuHostRegister", "npuHostUnregister"),
        unavailable=("torch.npu.npurt is unavailable in this torch_npu build, so host buffers cannot be "
                     "registered (npuHostRegister); buffers stay pageable; use pin_memory() copies instead"),
        failed="torch.npu.npurt() failed to initialise the NPU runtime")
