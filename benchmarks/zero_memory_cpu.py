"""Peak host memory of one training step on the CPU: polyaccel's ZeRO stage beside torch FSDP2 (world size 1).

    python benchmarks/zero_memory_cpu.py [--stage 3] [--layers 4 --hidden 512 --batch 4 --seq 512]

Each engine runs in its own process: three warm-up steps, then the kernel's high-water mark of
resident memory (VmHWM, reset through ``/proc/self/clear_refs``) is read over one more step.
glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``), so every large tensor is its own
mapping and its pages go back when it is freed: the peak then follows the live tensors, as a
device allocator's ``max_memory_allocated`` does. What this cannot show is what only a device
has (stream-ordered frees, side-stream copies); it tells whether a gap seen on a GPU comes from
the tensors an engine keeps, or from how they meet the device allocator. Linux only.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys

import torch

ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _measure(engine: str, args) -> dict:
    from zero_gpu import batches, build

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(args)
    n = sum(p.numel() for p in model.parameters())
    if engine == "polyaccel":
        import polyaccel

        eng = polyaccel.initialize(copy.deepcopy(model), {
            "bf16": {"enabled": True}, "zero_optimization": {"stage": args.stage},
            "optimizer": {"type": "adamw", "params": {"lr": 1e-4}}})

        def step(ids):
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
    else:
        import torch.distributed as dist
        from zero_peers import fsdp2_step

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=0, world_size=1)
        step, _close = fsdp2_step(copy.deepcopy(model), {"stage": args.stage}, torch.device("cpu"), 1e-4, 0.0)
    del model
    data = batches(args, 4)
    for ids in data[:3]:
        step(ids)
    gc.collect()
    start = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(data[3])
    return {"engine": engine, "params": n, "start_mib": start / 2**20, "peak_mib": _status_bytes("VmHWM") / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=3, help="ZeRO stage (FSDP2's matching setup)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--engine", choices=("polyaccel", "fsdp2"), help=argparse.SUPPRESS)  # the child's row
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(_measure(args.engine, args)))
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    rows = []
    for engine in ("polyaccel", "fsdp2"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--engine", engine],
                              capture_output=True, text=True, env={**os.environ, **ENV})
        if proc.returncode:
            print(f"{engine}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"Llama {args.layers}x{args.hidden}, {rows[0]['params'] / 1e6:.1f}M parameters, "
          f"batch {args.batch}x{args.seq}, bf16, AdamW, stage {args.stage}, one step on the CPU")
    for r in rows:
        print(f"{r['engine']:10s} resident before the step {r['start_mib']:8.1f} MiB, peak {r['peak_mib']:8.1f} MiB")
    print(f"polyaccel / fsdp2 peak: {rows[0]['peak_mib'] / rows[1]['peak_mib']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
