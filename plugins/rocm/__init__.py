"""The rocm plugin: AMD GPUs through torch's HIP build (``torch.cuda`` over HIP), RCCL, hipGraph.

It reuses the cuda plugin (allowed: rocm is cuda's HIP twin) and overrides where HIP differs:
detection (``torch.version.hip``), the collective library's name (RCCL, still torch.distributed's
"nccl" backend), fp8 formats (e4m3fnuz/e5m2fnuz on MI300, OCP formats on gfx950 and RDNA4),
wavefront size, and when Triton can run. The cuda plugin's op builders serve torch's device
type "cuda", so they serve this plugin's GPUs as well; their compatibility checks ask this
accelerator (``triton_device_support``).
"""

from polyaccel.hookspecs import hookimpl
from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION


@hookimpl
def polyaccel_accelerators():
    from .accelerator import RocmAccelerator

    return [RocmAccelerator]

