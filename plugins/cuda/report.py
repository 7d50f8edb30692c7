"""Facts the cuda plugin adds to ``polyaccel report``: runtime versions, devices, Triton status."""

from __future__ import annotations

import torch

from .triton_support import triton_compatible, triton_import


def report(accelerator) -> dict:
    out: dict = {
        "torch_cuda": getattr(torch.version, "cuda", None),
        "torch_hip": getattr(torch.version, "hip", None),
        "collective_library": getattr(accelerator, "collective_library", accelerator.communication_backend),
    }
    ok, why = triton_import()
    out["triton"] = why if ok else f"unavailable: {why}"
    tri_ok, tri_why = triton_compatible(accelerator)
    out["triton_builders"] = "usable" if tri_ok else f"not used: {tri_why}"
    probe = accelerator.probe()
    if probe.available:
        devices = []
        for i in range(probe.device_count):
            try:
                p = torch.cuda.get_device_properties(i)
                devices.append({"index": i, "name": p.name, "total_memory": int(p.total_memory),
                                "capability": f"{p.major}.{p.minor}",
                                "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
            except Exception as exc:  # noqa: BLE001 - a report never fails on one device
                devices.append({"index": i, "error": f"{type(exc).__name__}: {exc}"})
        out["devices"] = devices
        out["fp8_dtypes"] = [str(d).replace("torch.", "") for d in accelerator.fp8_dtypes()]
    return out
