"""Comm hooks of the cuda plugin: NCCL, with the local device passed to ``init_process_group``."""

from __future__ import annotations


def comm_hooks(accelerator):
    """NCCL binds a communicator to one GPU; giving ``device_id`` lets it connect eagerly and lets
    torch skip the device guess on the first collective (the rocm plugin reuses this: RCCL answers
    to the same torch.distributed backend name)."""
    from polyaccel.comm.hooks import CommHooks

    return CommHooks(backend=accelerator.communication_backend, pass_device_id=True)
