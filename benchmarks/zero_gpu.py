"""ZeRO on one GPU (world size 1) beside its peers: step time and peak memory per stage, with and without offload.

World size 1 shows the engine's own overhead (flat buffers, buckets, hooks, host copies) and what
offload saves; it cannot show communication savings. Baseline in the same process: plain torch
``AdamW(fused=True)`` on an fp32 model under bf16 autocast (the usual mixed-precision recipe,
16 bytes of state per parameter like ZeRO at world size 1). Peers in the same process, row by row
(``--peers``, each skipped with its reason when not installed): DeepSpeed's ZeRO with the same
section (offload buffers pinned) and torch FSDP2 (``zero_peers.py`` says how it is set up).

    python benchmarks/zero_gpu.py [--size 220m|1b] [--peers deepspeed,fsdp2] [--only "stage 3"] [--out x.json]
    python benchmarks/zero_gpu.py --isolate --rounds 3 --only "stage 3" --no-granular   # one process per row
    python benchmarks/zero_gpu.py --size 1b --kernels --isolate --rounds 3 --only "=stage 3" --no-granular
        # each polyaccel row again with the model kernels, and FSDP2 given Liger's kernels (zero_kernels.py)
    python benchmarks/zero_gpu.py --sp1 --peers "" --only "=stage 1,=stage 3" --no-granular --isolate --rounds 3
        # each polyaccel row again through the sequence_parallel layer at autosp_size 1 (AutoSP's no-op target:
        # within 2% of the row without it)

Every configuration starts from the same initial weights and sees the same batches, so the first
loss must agree across rows and the last losses should be close (bf16). A row's peak is the
largest device memory allocated during its steps less what earlier rows left allocated (printed).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time

import torch

CONFIGS = [
    ("stage 1", {"stage": 1}),
    ("stage 1 + offload_optimizer", {"stage": 1, "offload_optimizer": {"device": "cpu"}}),
    ("stage 2", {"stage": 2}),
    ("stage 2 + offload_optimizer", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    ("stage 3", {"stage": 3}),
    ("stage 3 + offload_optimizer", {"stage": 3, "offload_optimizer": {"device": "cpu"}}),
    ("stage 3 + offload_optimizer + offload_param",
     {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
]
# polyaccel only: decoder layers gathered whole (stage3_module_granularity_threshold); peers run the plain row
GRANULAR = {"stage3_module_granularity_threshold": 60_000_000}
# --kernels rows: the model kernels swapped in (polyaccel), Liger's given to FSDP2 (zero_kernels.py)
from zero_kernels import KERNELS, LIGER, liger_fsdp2_step  # noqa: E402
from zero_kernels import report as kernels_report  # noqa: E402
from zero_peers import optimizer_step  # noqa: E402

# --sp1 rows: the same model through AutoSP's layer at sequence-parallel size 1 (no all-to-all, no copy)
SP1 = {"sequence_parallel": {"autosp_size": 1, "seq_dim": 1}}

# --muon rows: ZeRO's Muon (bf16 Newton-Schulz, 5 steps) with the AdamW rows' settings for its auxiliary Adam
MUON_PARAMS = {"lr": 0.02, "weight_decay": 0.01, "adam_lr": 1e-4, "adam_weight_decay": 0.01}
# the Muon row's step time over its AdamW row's (issue 49)
MUON_TARGETS = {"stage 1": 1.15, "stage 1 + offload_optimizer": 2.0}

SIZES = {  # Llama shapes: 219.7M and 0.95B parameters
    "220m": {"layers": 12, "hidden": 1024},
    "1b": {"layers": 16, "hidden": 2048},
}


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def batches(args, n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32000, (args.batch, args.seq), generator=g) for _ in range(n)]


def run(step_fn, data, device, sync):
    times, losses = [], []
    for i, ids in enumerate(data):
        ids = ids.to(device, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        loss = step_fn(ids)
        sync()
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


BASELINE = "torch AdamW(fused) fp32 + bf16 autocast"


def wanted(args, name: str) -> bool:
    """Whether ``--only`` selects configuration ``name``: any of its comma-separated items is part of the name, or
    is the whole name where the item starts with '='."""
    if not args.only:
        return True
    return any(name == item[1:] if item.startswith("=") else item in name for item in args.only.split(","))


def ratios_for(args, zero: dict) -> list[float]:
    """The ``--ratio`` values that apply to configuration ``zero`` (an offloaded optimizer, parameters not)."""
    if not args.ratio or "offload_optimizer" not in zero or "offload_param" in zero:
        return []
    return [float(r) for r in args.ratio.split(",")]


def row_names(args, peers) -> list[str]:
    """The rows ``main`` runs for these arguments, in order (``--isolate`` runs each in its own process)."""
    from zero_peers import fsdp2_unsupported

    names = [BASELINE]
    for name, zero in CONFIGS:
        if not wanted(args, name):
            continue
        names.append(f"polyaccel {name}")
        if args.muon:
            names.append(f"polyaccel {name} muon")
        if args.sp1:
            names.append(f"polyaccel {name} sp1")
        if args.kernels:
            names.append(f"polyaccel {name} kernels")
        names.extend(f"polyaccel {name} ratio {r}" for r in ratios_for(args, zero))
        if zero["stage"] == 3 and args.granular:
            names.append(f"polyaccel {name} (layer granularity)")
        names.extend(f"{peer} {name}" for peer in peers if peer != "fsdp2" or fsdp2_unsupported(zero) is None)
        if args.kernels and "fsdp2" in peers and fsdp2_unsupported(zero) is None:
            names.append(f"{LIGER} {name}")
    return names


def run_isolated(args, peers) -> int:
    """Every row in a fresh process, ``--rounds`` times over, the rows interleaved within a round (so a slow
    stretch of the host falls on every row alike); a row's step time is the mean over the rounds."""
    import subprocess
    import sys
    import tempfile

    argv, rest = [], iter(sys.argv[1:])
    for a in rest:  # the child gets the same arguments less these (each as "--flag value" or "--flag=value")
        if a == "--isolate" or a.startswith(("--out=", "--rounds=")):
            continue
        if a in ("--out", "--rounds"):
            next(rest, None)
            continue
        argv.append(a)
    names = row_names(args, peers)
    runs: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}
    skipped: set[str] = set()
    params = None
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for i, name in enumerate(names):
                if name in skipped or name in failed:
                    continue
                out = os.path.join(tmp, f"{rnd}-{i}.json")
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--row", name, "--out", out],
                                      capture_output=True, text=True)
                result = {"rows": []}
                if os.path.exists(out):
                    with open(out) as f:
                        result = json.load(f)
                got = result["rows"]
                if not got:
                    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                    skip = [line for line in tail if "skipped" in line]
                    if skip:
                        skipped.add(name)
                        print(skip[0], flush=True)
                    else:
                        failed[name] = f"exit {proc.returncode}"
                        print(f"{name}: FAILED (exit {proc.returncode}): {' | '.join(tail)}", flush=True)
                    continue
                r = got[0]
                if "error" in r:
                    failed[name] = r["error"]
                    print(f"{name}: FAILED {r['error']}", flush=True)
                    continue
                runs.setdefault(name, []).append(r)
                where = f"own process, round {rnd + 1} of {args.rounds}" if args.rounds > 1 else "own process"
                print(f"{name:45s} {r['step_ms']:9.1f} ms {r['peak_gib']:7.2f} GiB ({where})", flush=True)
                params = result["params"]
    report(args, peers, merge_rounds(names, runs, failed), params)
    return 0


def merge_rounds(names: list[str], runs: dict[str, list[dict]], failed: dict[str, str]) -> list[dict]:
    """One row per name, in ``names``' order: the mean step time over its rounds (tokens/s to match), the
    highest peak, and each round's time in ``round_ms``; a row that failed in any round is an error row, and
    one that never ran (skipped) is left out."""
    import statistics

    rows = []
    for name in names:
        if name in failed:
            rows.append({"config": name, "error": failed[name]})
        elif name in runs:
            got = runs[name]
            ms = statistics.mean(r["step_ms"] for r in got)
            rows.append({**got[0], "step_ms": ms, "tokens_per_s": got[0]["tokens_per_s"] * got[0]["step_ms"] / ms,
                         "peak_gib": max(r["peak_gib"] for r in got), "round_ms": [r["step_ms"] for r in got]})
    return rows


def report(args, peers, rows, n_params=None) -> None:
    """Print the table and the polyaccel/peer ratios; write ``--out``."""
    base = next((r for r in rows if r["config"] == BASELINE and "error" not in r), None)
    by_name = {r["config"]: r for r in rows if "error" not in r}
    print(f"\nmodel: Llama {args.layers}x{args.hidden}, batch {args.batch}x{args.seq}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print(f"{'config':45s} {'step ms':>9s} {'vs torch':>9s} {'peak GiB':>9s} {'B/param':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:45s} FAILED: {r['error']}")
            continue
        speed = f"{base['step_ms'] / r['step_ms']:9.2f}" if base else f"{'':9s}"
        rounds = "  rounds: " + ", ".join(f"{ms:.1f}" for ms in r["round_ms"]) if len(r.get("round_ms", [])) > 1 else ""
        print(f"{r['config']:45s} {r['step_ms']:9.1f} {speed} {r['peak_gib']:9.2f} {r['bytes_per_param']:8.1f}{rounds}")
    print("\npolyaccel / peer (time below 1: polyaccel faster; memory below 1: polyaccel smaller)")
    for name, _ in CONFIGS:
        ours = by_name.get(f"polyaccel {name}")
        for peer in peers:
            theirs = by_name.get(f"{peer} {name}")
            if ours and theirs and theirs["step_ms"] and theirs["peak_gib"]:
                print(f"{name:45s} vs {peer:9s} time {ours['step_ms'] / theirs['step_ms']:5.2f}  "
                      f"memory {ours['peak_gib'] / theirs['peak_gib']:5.2f}")
    if args.muon:
        print("\nmuon / adamw, polyaccel (time: the Muon step over the AdamW step of the same row; targets: "
              + ", ".join(f"{k} <= {v}" for k, v in MUON_TARGETS.items()) + ")")
        for name, _ in CONFIGS:
            ours, adamw = by_name.get(f"polyaccel {name} muon"), by_name.get(f"polyaccel {name}")
            if ours and adamw:
                memory = f"memory {ours['peak_gib'] / adamw['peak_gib']:5.2f}" if adamw["peak_gib"] else ""
                ratio, target = ours["step_ms"] / adamw["step_ms"], MUON_TARGETS.get(name)
                verdict = "" if target is None else f"  target <= {target}: {'met' if ratio <= target else 'NOT met'}"
                print(f"{name:45s} time {ratio:5.2f}  {memory}{verdict}")
    if args.sp1:
        print("\nsequence_parallel autosp_size 1 / without the layer, polyaccel (target: time <= 1.02)")
        for name, _ in CONFIGS:
            ours, plain = by_name.get(f"polyaccel {name} sp1"), by_name.get(f"polyaccel {name}")
            if ours and plain:
                memory = f"memory {ours['peak_gib'] / plain['peak_gib']:5.2f}" if plain["peak_gib"] else ""
                # the same first loss (same weights, same batch); the last within run-to-run noise (two processes'
                # GPU reductions are not bitwise reproducible: the plain row differs from itself by as much)
                first = ours["first_loss"] == plain["first_loss"]
                last = abs(ours["last_loss"] - plain["last_loss"]) <= 1e-4 * abs(plain["last_loss"])
                print(f"{name:45s} time {ours['step_ms'] / plain['step_ms']:5.3f}  {memory}  first loss "
                      f"{'equal' if first else 'DIFFERS'}, last {'within 1e-4' if last else 'DIFFERS'} "
                      f"({ours['last_loss']:.6f} vs {plain['last_loss']:.6f})")
    if args.kernels:
        kernels_report(by_name, CONFIGS, BASELINE)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": n_params, "args": vars(args), "rows": rows}, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="220m", help="model preset (default 220m)")
    ap.add_argument("--layers", type=int, help="override the preset's decoder layers")
    ap.add_argument("--hidden", type=int, help="override the preset's hidden size")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row, after 3 warm-up steps")
    ap.add_argument("--bucket", type=int, default=50_000_000)
    ap.add_argument("--peers", default="deepspeed,fsdp2", help="comma-separated peers to run ('' for none)")
    ap.add_argument("--only", default=None,
                    help="run only the configurations whose name contains this (several: comma-separated; an item "
                         "starting with '=' must be the whole name, e.g. '=stage 1,=stage 3')")
    ap.add_argument("--no-granular", dest="granular", action="store_false",
                    help="skip the extra stage-3 rows with decoder layers gathered whole")
    ap.add_argument("--isolate", action="store_true",
                    help="run every row in a fresh process (peaks then cannot include memory an earlier row left)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --isolate: run every row this many times (interleaved) and report the mean step time")
    ap.add_argument("--muon", action="store_true",
                    help="after each polyaccel row, the same row with optimizer.type muon (Muon on the hidden "
                         "matrices, AdamW on the rest) and its time against the AdamW row")
    ap.add_argument("--sp1", action="store_true",
                    help="after each polyaccel row, the same row with the sequence_parallel layer at autosp_size 1 "
                         "(AutoSP as a no-op) and its time against the row without the layer")
    ap.add_argument("--kernels", action="store_true",
                    help="after each polyaccel row, the same row with the model kernels (RMSNorm, RoPE, SwiGLU, fused "
                         "linear cross-entropy); with the fsdp2 peer also FSDP2 given Liger's kernels (needs "
                         "--isolate: Liger patches Hugging Face's classes process-wide)")
    ap.add_argument("--ratio", default=None,
                    help="after each offload_optimizer row without offload_param, the same row with "
                         "offload_optimizer.ratio set to each of these comma-separated values (the host's share of "
                         "the optimizer; polyaccel only)")
    ap.add_argument("--host-threads", type=int, default=None, metavar="N",
                    help="offload_optimizer.host_threads of the offloaded rows (the overlapped host step's CPU "
                         "threads; default: one fewer than torch's)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # --isolate's child: run this row only
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    peers = [p for p in args.peers.split(",") if p]
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.rounds > 1 and not args.isolate:
        ap.error("--rounds needs --isolate (rows run in one process share its allocator and caches)")
    if args.kernels and "fsdp2" in peers and not (args.isolate or args.row):
        ap.error("--kernels with the fsdp2 peer needs --isolate (Liger's kernels patch Hugging Face's Llama classes "
                 "for the whole process)")

    if args.isolate:
        return run_isolated(args, peers)

    import polyaccel
    import polyaccel.comm
    from zero_peers import PeerUnavailable, deepspeed_step, fsdp2_step

    # one process group of one, shared by every engine; DeepSpeed also reads the launcher's variables
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    polyaccel.comm.init_distributed(init_method="env://", rank=0, world_size=1)

    acc = polyaccel.get_accelerator()
    device = acc.device()
    sync = acc.synchronize
    has_mem = acc.has("memory_stats")
    reset_peak = acc.reset_peak_memory_stats if has_mem else (lambda: None)
    peak_now = acc.max_memory_allocated if has_mem else (lambda: 0)
    held_now = acc.memory_allocated if has_mem else (lambda: 0)
    base_model = build(args)
    n_params = sum(p.numel() for p in base_model.parameters())
    data = batches(args, args.steps + 3)
    tokens = args.batch * args.seq
    rows = []

    def record(name, times, losses, peak, extra=None, leftover=0):
        med = statistics.median(times)
        row = {"config": name, "step_ms": med * 1e3, "tokens_per_s": tokens / med, "peak_gib": peak / 2**30,
               "leftover_gib": leftover / 2**30,
               "bytes_per_param": peak / n_params, "first_loss": losses[0], "last_loss": losses[-1], **(extra or {})}
        rows.append(row)
        if args.out:  # after every row, so a run cut short still leaves its numbers
            with open(args.out, "w") as f:
                json.dump({"params": n_params, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"{name:45s} {row['step_ms']:9.1f} ms {row['tokens_per_s']:10.0f} tok/s {row['peak_gib']:7.2f} GiB "
              f"(of which left by earlier rows: {row['leftover_gib']:.2f} GiB) "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} {extra or ''}", flush=True)

    def torch_row():
        """Baseline: fp32 weights, bf16 autocast, torch's fused AdamW."""
        model = copy.deepcopy(base_model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        return optimizer_step(model, opt, device), lambda: None, None

    def measure(name, make):
        """Run one row; ``make()`` returns (step_fn, close, extra). Device memory an earlier row left
        allocated (an engine that does not free everything on close) is reported as ``leftover_gib``:
        the peak includes it, as it may be freed during this row (``--isolate`` avoids both)."""
        if args.row is not None and name != args.row:
            return
        try:
            leftover = held_now()
            step, close, extra = make()
            reset_peak()
            times, losses = run(step, data, device, sync)
            record(name, times, losses, peak_now(), extra, leftover)
            step = None
            close()
            close = None  # a bound method of the engine: let it go before the collection below
        except PeerUnavailable as exc:
            print(f"{name}: skipped ({exc})", flush=True)
        except Exception as exc:  # noqa: BLE001 - record the failure, go on with the other rows
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        acc.empty_cache()

    measure(BASELINE, torch_row)
    for name, zero in CONFIGS:
        if not wanted(args, name):
            continue
        zero = {"reduce_bucket_size": args.bucket, **zero}
        if args.host_threads is not None and "offload_optimizer" in zero:
            zero["offload_optimizer"] = {**zero["offload_optimizer"], "host_threads": args.host_threads}
        config = {"bf16": {"enabled": True}, "zero_optimization": zero,
                  "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}

        def polyaccel_row(config=config):
            engine = polyaccel.initialize(copy.deepcopy(base_model), config)
            if "kernels" in config:
                from polyaccel.parallel import get_plan

                print(str(get_plan(engine.module, "kernels")).split("\nswapped:")[0], flush=True)

            def zero_step(ids):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                return loss.detach()

            extra = {"engine": "polyaccel", "optimizer_builder": engine.optimizer_builder}
            if engine.offload_optimizer:
                extra["host_optimizer_share"] = round(engine.host_optimizer_share, 3)
            return zero_step, engine.destroy, extra

        measure(f"polyaccel {name}", polyaccel_row)
        if args.muon:
            muon = {**config, "optimizer": {"type": "muon", "params": MUON_PARAMS}}
            measure(f"polyaccel {name} muon", lambda c=muon: polyaccel_row(c))
        if args.sp1:
            measure(f"polyaccel {name} sp1", lambda c={**config, **SP1}: polyaccel_row(c))
        if args.kernels:
            measure(f"polyaccel {name} kernels", lambda c={**config, "kernels": dict(KERNELS)}: polyaccel_row(c))
        for r in ratios_for(args, zero):
            part = {**config, "zero_optimization": {**zero, "offload_optimizer": {**zero["offload_optimizer"],
                                                                                 "ratio": r}}}
            measure(f"polyaccel {name} ratio {r}", lambda c=part: polyaccel_row(c))
        if zero["stage"] == 3 and args.granular:
            granular = {**config, "zero_optimization": {**zero, **GRANULAR}}
            measure(f"polyaccel {name} (layer granularity)", lambda c=granular: polyaccel_row(c))
        if "deepspeed" in peers:
            measure(f"deepspeed {name}", lambda zero=zero: (
                *deepspeed_step(copy.deepcopy(base_model), zero, args.batch, 1e-4, 0.01), {"engine": "deepspeed"}))
        if "fsdp2" in peers:
            measure(f"fsdp2 {name}", lambda zero=zero: (
                *fsdp2_step(copy.deepcopy(base_model), zero, device, 1e-4, 0.01), {"engine": "fsdp2"}))
        if args.kernels and "fsdp2" in peers:
            measure(f"{LIGER} {name}", lambda zero=zero: (
                *liger_fsdp2_step(copy.deepcopy(base_model), zero, device, 1e-4, 0.01), {"engine": LIGER}))

    report(args, peers, rows, n_params)
    polyaccel.comm.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
