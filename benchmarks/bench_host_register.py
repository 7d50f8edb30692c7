"""Registering an existing 1 GiB host buffer (cudaHostRegister) vs copying it into pinned memory.

    python benchmarks/bench_host_register.py [--gib 1] [--repeats 3]

Both sides start from the same kind of existing, touched, pageable 1 GiB buffer. ``pin_memory()``
allocates page-locked memory and copies; registration page-locks the buffer in place. Each
repetition uses a fresh buffer and keeps every result alive, so torch's caching host allocator
cannot hand back a block pinned by an earlier repetition. H2D bandwidth is timed with CUDA events
(median of several copies) from each kind of buffer, pageable for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchlib
import torch
from benchlib import Row


def _fresh(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    t.uniform_()  # touch every page: registration must not be charged for first-touch faults
    return t


def _h2d_gbs(src: torch.Tensor, dst: torch.Tensor, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return src.numel() * src.element_size() / (statistics.median(times) * 1e-3) / 1e9


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv or [])
    device = benchlib.require_gpu()
    from polyaccel.plugins.cuda.accelerator import CudaAccelerator

    acc = CudaAccelerator()
    acc.require("host_register")
    nbytes = int(args.gib * (1 << 30))
    pinned_copies, registered, t_pin, t_reg, t_unreg = [], [], [], [], []
    for _ in range(args.repeats):
        src = _fresh(nbytes)
        t0 = time.perf_counter()
        pinned_copies.append(src.pin_memory())
        t_pin.append(time.perf_counter() - t0)
        del src
        buf = _fresh(nbytes)
        t0 = time.perf_counter()
        acc.register_host_memory(buf)
        t_reg.append(time.perf_counter() - t0)
        registered.append(buf)
    assert all(acc.is_pinned(b) for b in registered), "a registered buffer is not reported as pinned"
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    bw_pinned = _h2d_gbs(pinned_copies[0], dst)
    bw_reg = _h2d_gbs(registered[0], dst)
    torch.cuda.synchronize()
    assert torch.equal(dst[:4096].cpu(), registered[0][:4096]), "H2D copy from the registered buffer is wrong"
    pageable = _fresh(nbytes)
    bw_pageable = _h2d_gbs(pageable, dst, repeats=3)
    for buf in registered:
        t0 = time.perf_counter()
        acc.unregister_host_memory(buf)
        t_unreg.append(time.perf_counter() - t0)
    pin_s, reg_s, unreg_s = (statistics.median(x) for x in (t_pin, t_reg, t_unreg))
    gib = args.gib
    rows = [
        Row("host_register", f"make an existing {gib:g} GiB buffer DMA-ready", "s", "tensor.pin_memory()", pin_s,
            reg_s, target=">= 5x cheaper", met=pin_s / reg_s >= 5,
            detail=f"median of {args.repeats} fresh buffers; cudaHostUnregister {unreg_s * 1e3:.1f} ms; "
                   f"register+unregister {(reg_s + unreg_s) / pin_s:.1%} of pin_memory()"),
        Row("host_register", f"H2D {gib:g} GiB from registered vs pin_memory() buffer", "GB/s", "pin_memory() buffer",
            bw_pinned, bw_reg, higher_is_better=True, target="equal (>= 95%)", met=bw_reg >= 0.95 * bw_pinned,
            detail=f"pageable source: {bw_pageable:.1f} GB/s"),
    ]
    return rows


if __name__ == "__main__":
    benchlib.run_standalone(main)
