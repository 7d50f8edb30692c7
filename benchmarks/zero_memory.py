"""Where a ZeRO step's device memory goes, phase by phase, beside plain torch (world size 1).

    python benchmarks/zero_memory.py [--size 220m] [--stages 1,2,3] [--snapshot DIR]

For each engine: memory held after set-up, then per phase of the third step the memory held at
its start and the peak inside it (forward, backward, optimizer step), in GiB. The difference
between two engines' peaks in the same phase points at the buffers one of them keeps. With
``--snapshot DIR`` (CUDA), each engine's allocations are recorded from before it is built and
``memory_peak.py`` prints what is live at its peak, by allocation site (the pickle stays in DIR).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import pickle

import torch


def live_device_tensors(device: torch.device, top: int) -> str:
    """The largest storages on ``device`` that Python still references, with one tensor's dtype and shape each."""
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device.type and obj.numel():
                st = obj.untyped_storage()
                storages.setdefault(st.data_ptr(), (st.nbytes(), obj.dtype, tuple(obj.shape)))
        except (RuntimeError, ReferenceError):
            continue
    rows = sorted(storages.values(), key=lambda r: -r[0])
    total = sum(r[0] for r in rows) / 2.0**30
    lines = [f"    {nb / 2.0**30:6.3f} GiB  {dt} {list(sh)}" for nb, dt, sh in rows[:top]]
    return f"  live on {device.type}: {total:.2f} GiB in {len(rows)} storages, largest:\n" + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="220m")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--offload", action="store_true", help="offload the optimizer too")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--snapshot", metavar="DIR", help="record each engine's allocations (CUDA) and report its peak")
    ap.add_argument("--live", type=int, default=8, metavar="N",
                    help="after each engine's steps, list the N largest storages still referenced (0: none)")
    args = ap.parse_args()

    import polyaccel
    from zero_gpu import SIZES, batches, build

    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    acc = polyaccel.get_accelerator()
    device = acc.device()
    gib = 2.0**30
    base_model = build(args)
    data = batches(args, 3)

    def record(name):
        """Start recording allocations for ``name``'s engine; returns the function that ends and reports it."""
        if not args.snapshot or device.type != "cuda":
            return lambda: None
        from memory_peak import peak_report

        os.makedirs(args.snapshot, exist_ok=True)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", clear_history=True)

        def finish():
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            path = os.path.join(args.snapshot, name.replace(" ", "_") + ".pickle")
            with open(path, "wb") as f:
                pickle.dump(snap, f)
            print(peak_report(snap), flush=True)
        return finish

    def phases(name, forward, backward, step):
        rows = []
        for i, ids in enumerate(data):
            ids = ids.to(device)
            marks = []
            for phase, fn in (("forward", lambda ids=ids: forward(ids)), ("backward", None), ("step", step)):
                acc.synchronize()
                acc.reset_peak_memory_stats()
                at_start = acc.memory_allocated()
                if phase == "forward":
                    loss = fn()
                elif phase == "backward":
                    backward(loss)
                    loss = None
                else:
                    fn()
                acc.synchronize()
                marks.append((phase, at_start / gib, acc.max_memory_allocated() / gib))
            if i == len(data) - 1:
                rows = marks
        print(f"{name:28s} " + "  ".join(f"{p}: {a:6.2f} -> peak {m:6.2f}" for p, a, m in rows)
              + f"  | after: {acc.memory_allocated() / gib:6.2f}", flush=True)
        if args.live:
            print(live_device_tensors(device, args.live), flush=True)

    done = record("torch")
    model = copy.deepcopy(base_model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def torch_forward(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    phases("torch AdamW fused + autocast", torch_forward, lambda loss: loss.backward(),
           lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    done()
    model = opt = None
    gc.collect()
    acc.empty_cache()

    for stage in (int(s) for s in args.stages.split(",")):
        zero = {"stage": stage, "reduce_bucket_size": 50_000_000}
        if args.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        done = record(f"stage {stage}")
        engine = polyaccel.initialize(copy.deepcopy(base_model), {
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}})
        phases(f"polyaccel stage {stage}", lambda ids, engine=engine: engine(input_ids=ids, labels=ids).loss,
               engine.backward, engine.step)
        done()
        engine.destroy()
        engine = None
        gc.collect()
        acc.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
