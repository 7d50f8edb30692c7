"""Where an offloaded ZeRO step spends its time, phase by phase, and the host pieces in isolation.

    python benchmarks/zero_offload_phases.py [--stage 2] [--layers 12 --hidden 1024 --batch 8 --seq 1024]

Times (device-synchronised, median of the timed steps) forward, backward (with the gradient
reductions and the copies to the host), the host optimizer step and the upload of the
updated parameters; then, on a buffer as large as the model, each host-side piece alone:
copy down, fp32 += bf16 on the host, fp32 -> bf16 on the host, copy up, and the host Adam, with
the host's memory bandwidth (an fp32 copy, read + write) and the host Adam's GB/s against it
(28 bytes an element: p, g, m, v read, p, m, v written). With ``--overlap`` it also prints, per
bucket of the last step, when the worker thread stepped it relative to the start of backward and
when backward ended (is the host step running under backward, and how much is left after it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, sync, repeat=5):
    out = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--overlap", action="store_true",
                    help="let the host step run during backward (then only forward/backward/step totals are timed)")
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="with --overlap: intra-op threads of the host-step worker thread (default: torch's), to "
                         "see whether it contends with the threads that launch backward")
    args = ap.parse_args()

    import polyaccel
    from zero_gpu import batches, build

    acc = polyaccel.get_accelerator()
    device, sync = acc.device(), acc.synchronize
    print(f"torch threads {torch.get_num_threads()}, accelerator {acc.name}, host-step worker threads "
          f"{args.worker_threads or 'default'}")
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 50_000_000,
                                                               "offload_optimizer": {"device": "cpu",
                                                                                     "overlap_step": args.overlap}},
              "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine = polyaccel.initialize(build(args), config)
    phases: dict[str, list[float]] = {}
    this_step: dict[str, float] = {}  # a phase called several times per step (one slice per bucket) is summed

    def wrap(obj, name, label):
        fn = getattr(obj, name)

        def timed_call(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            this_step[label] = this_step.get(label, 0.0) + (time.perf_counter() - t0) * 1e3
            return out
        setattr(obj, name, timed_call)

    part = engine.partitioner
    timeline: list[tuple[str, float, float]] = []  # (what, start, end) of the last step, perf_counter seconds
    if args.overlap:
        stepper = engine.stepper
        run_bucket = stepper._run

        def timed_run(ranges, event):
            if args.worker_threads:
                torch.set_num_threads(args.worker_threads)  # the worker's own OpenMP setting (thread-local)
            t0 = time.perf_counter()
            run_bucket(ranges, event)
            timeline.append((f"bucket {ranges[0][0]}..{ranges[-1][1]}", t0, time.perf_counter()))
        stepper._run = timed_run
    if not args.overlap:  # the slices run on a worker thread during backward otherwise
        wrap(part, "end_backward", "end of backward (reductions, copies down, host adds)")
        wrap(part, "reduce_at_boundary", "reduce at boundary")
        wrap(engine.optimizer, "step_slice", "host optimizer step (all slices)")
        wrap(part, "upload", "host convert + start of uploads (all slices)")
        wrap(part, "publish", "rest of the upload + gather of parameters")
    for i, ids in enumerate(batches(args, args.steps)):
        ids = ids.to(device)
        sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        sync()
        t3 = time.perf_counter()
        if i <= 1:
            phases.clear()
        for k, v in this_step.items():
            phases.setdefault(k, []).append(v)
        this_step.clear()
        if i == args.steps - 1 and timeline:
            print(f"last step's host step per bucket, ms from the start of backward (backward ended at "
                  f"{(t2 - t1) * 1e3:.1f}, the step at {(t3 - t1) * 1e3:.1f}):")
            for what, a, b in timeline:
                print(f"  {what:40s} {(a - t1) * 1e3:7.1f} .. {(b - t1) * 1e3:7.1f}")
        timeline.clear()
        if i >= 1:
            for k, v in (("forward", t1 - t0), ("backward (all)", t2 - t1), ("step (all)", t3 - t2),
                         ("whole step", t3 - t0)):
                phases.setdefault(k, []).append(v * 1e3)
    for k, v in phases.items():
        print(f"{k:55s} {statistics.median(v):8.1f} ms")

    n = part.master.numel()
    dev16 = torch.randn(n, device=device).to(torch.bfloat16)
    pin16 = acc.empty_pinned((n,), torch.bfloat16)
    host32 = torch.randn(n)
    pin32 = acc.empty_pinned((n,), torch.float32)
    pin32.copy_(host32)
    print(f"\nisolated, {n / 1e6:.1f} M elements")
    print(f"{'copy down bf16 -> pinned bf16':55s} {timed(lambda: pin16.copy_(dev16, non_blocking=True), sync):8.1f} ms")
    print(f"{'host fp32 += pinned bf16':55s} {timed(lambda: pin32.add_(pin16), sync):8.1f} ms")
    print(f"{'host pinned bf16 <- fp32 (convert)':55s} {timed(lambda: pin16.copy_(pin32), sync):8.1f} ms")
    print(f"{'copy up pinned bf16 -> device':55s} {timed(lambda: dev16.copy_(pin16, non_blocking=True), sync):8.1f} ms")
    print(f"{'copy down bf16 -> host fp32 (converting copy)':55s} {timed(lambda: pin32.copy_(dev16), sync):8.1f} ms")
    m, v, g = torch.zeros(n), torch.zeros(n), torch.randn(n)
    adam = lambda: torch._fused_adamw_([pin32], [g], [m], [v], [], [torch.tensor(1.0)], lr=1e-4, beta1=0.9,  # noqa: E731
                                       beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    adam_ms = timed(adam, sync)
    print(f"{'host fused AdamW (torch, fp32)':55s} {adam_ms:8.1f} ms")
    src32 = torch.randn(n)
    copy_ms = timed(lambda: host32.copy_(src32), sync)
    bw = 8 * n / copy_ms / 1e6
    print(f"{'host memory bandwidth (fp32 copy, read + write)':55s} {copy_ms:8.1f} ms = {bw:6.1f} GB/s "
          f"({torch.get_num_threads()} threads)")
    print(f"{'host AdamW traffic (28 B/element)':55s} {28 * n / adam_ms / 1e6:8.1f} GB/s = "
          f"{28 * n / adam_ms / 1e6 / bw:.2f}x the copy bandwidth")
    engine.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
