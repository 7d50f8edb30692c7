"""AutoSP over several GPUs: tokens/s and peak memory against sequence length, at sp 1/2/4/8.

    torchrun --nproc-per-node 8 benchmarks/autosp_gpu.py [--sp 1,2,4,8] [--seq 4096,8192,16384,32768]
                                                          [--size 220m|1b] [--batch 1] [--steps 5] [--json out.json]
    python benchmarks/autosp_gpu.py --smoke       # tiny sizes on 2 CPU ranks over gloo (it starts them itself)

Every row trains the same Llama (``--size``; the 220M preset is benchmarks/zero_gpu.py's) with ZeRO stage 3,
bf16 and AdamW over all the ranks torchrun started, with ``{"sequence_parallel": {"autosp_size": S}}``:
sequence groups of S adjacent ranks, data parallelism over the ``world / S`` groups. Each data rank draws
``--batch`` sequences of the row's length; each rank of its sequence group feeds its contiguous ``1/S`` of
them (``polyaccel.sequence.split_batch``). A row reports

- tokens/s: the tokens of one step over the whole world, each counted once (``world / S x batch x seq``),
  divided by the median step time after ``--warmup`` steps;
- peak memory: the largest ``max_memory_allocated`` over the ranks during the row's steps (GiB), and what
  the ranks held before the row started (the model's ZeRO partitions and optimizer state), so that
  ``peak - before`` is the step's working memory: activations and the gathered parameters;
- the first and last loss of data rank 0's rows (the whole sequences' loss, summed over its sequence group):
  the same initial weights and rows at every sp for one length, so the first loss agrees across sp (to bf16).

Rows run from short to long sequences; a row that runs out of memory is reported as OOM and the longer
sequences of that sp are skipped (every rank of a row holds the same shapes, so they run out together;
one that did not would wait in a collective until the process group's timeout, ``--timeout``).
An sp larger than the ranks (or than the GPUs) is refused before anything runs, naming the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SIZES = {  # Llama shapes as in benchmarks/zero_gpu.py: 219.7M and 0.95B parameters (head size 64)
    "220m": {"layers": 12, "hidden": 1024, "vocab": 32000},
    "1b": {"layers": 16, "hidden": 2048, "vocab": 32000},
    "smoke": {"layers": 2, "hidden": 64, "vocab": 128},
}
SMOKE_RANKS = 2  # --smoke without torchrun
#: --smoke's defaults (flags given beside it still win)
SMOKE = {"size": "smoke", "sp": "1,2", "seq": "32,64", "batch": 2, "steps": 2, "warmup": 1, "dtype": "fp32"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="220m", help="Llama preset (default 220m)")
    ap.add_argument("--sp", default="1,2,4,8", help="comma-separated sequence-parallel sizes (default 1,2,4,8)")
    ap.add_argument("--seq", default="4096,8192,16384,32768", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=1, help="sequences per data rank per step (default 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="training precision (default bf16)")
    ap.add_argument("--attn", default="sdpa", help="Hugging Face attention implementation (default sdpa)")
    ap.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds (default 600)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON (after every row)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (" + ", ".join(f"--{k} {v}" for k, v in SMOKE.items()) + ") on CPU ranks over "
                         "gloo; without torchrun it starts 2 ranks")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    args.sp_list = _ints(ap, "--sp", args.sp)
    args.seq_list = sorted(_ints(ap, "--seq", args.seq))
    for flag in ("batch", "steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def _ints(ap, flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag} {text!r}: comma-separated positive integers, e.g. 1,2,4")
    if not values or any(v < 1 for v in values):
        ap.error(f"{flag} {text!r}: comma-separated positive integers, e.g. 1,2,4")
    return values


def check_layout(args, world: int, devices: int | None, heads: int) -> None:
    """Refuse what cannot run before any row starts: sp above the ranks or the GPUs, sp not dividing the ranks,
    a sequence length or head count that sp does not divide."""
    too_big = [s for s in args.sp_list if s > world]
    if too_big:
        raise SystemExit(f"autosp_gpu.py: --sp {','.join(map(str, too_big))} needs more ranks than this run has: "
                         f"{world} rank(s) (torchrun --nproc-per-node {world}); an sp of S splits each sequence over "
                         f"S ranks, one GPU each. Drop those sizes or start more ranks "
                         f"(torchrun --nproc-per-node {max(too_big)} ...)")
    if devices is not None and world > devices:
        raise SystemExit(f"autosp_gpu.py: {world} ranks but this host has {devices} GPU(s): one rank per GPU; "
                         f"start it with torchrun --nproc-per-node {devices} and --sp sizes up to {devices}")
    for s in args.sp_list:
        if world % s:
            raise SystemExit(f"autosp_gpu.py: --sp {s} does not divide the {world} ranks (ranks = data x sequence); "
                             f"sizes that fit: {[d for d in range(1, world + 1) if world % d == 0]}")
        if heads % s:
            raise SystemExit(f"autosp_gpu.py: --sp {s} does not divide the model's {heads} attention heads "
                             f"(--size {args.size}); Ulysses attention gives each sequence rank whole heads")
        bad = [n for n in args.seq_list if n % s]
        if bad:
            raise SystemExit(f"autosp_gpu.py: --sp {s} does not divide --seq {','.join(map(str, bad))}; "
                             f"use lengths that are multiples of {max(args.sp_list)}")


def build(args, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[args.size]
    torch.manual_seed(0)
    heads = max(1, shape["hidden"] // 64) if args.size != "smoke" else 4
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                      intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = args.attn
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def heads_of(args) -> int:
    return max(1, SIZES[args.size]["hidden"] // 64) if args.size != "smoke" else 4


def batches(args, seq: int, data_rank: int, n: int) -> list[torch.Tensor]:
    """``n`` steps of this data rank's rows: a stream of its own per (length, data rank), so data rank 0 trains on
    the same rows at every sp."""
    g = torch.Generator().manual_seed(seq * 1009 + data_rank)
    return [torch.randint(0, SIZES[args.size]["vocab"], (args.batch, seq), generator=g) for _ in range(n)]


def run_row(args, sp: int, seq: int, acc, device) -> dict:
    """One (sp, seq) row on every rank; returns this rank's numbers."""
    import polyaccel
    from polyaccel import comm
    from polyaccel.sequence import split_batch

    world = comm.get_world_size()
    config = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
              "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "sequence_parallel": {"autosp_size": sp, "seq_dim": 1}}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine = polyaccel.initialize(build(args, seq).to(device), config)
    try:
        mesh = engine.mesh
        data_rank = mesh.rank("batch")
        sp_rank = mesh.rank("sequence") if sp > 1 else 0
        steps = batches(args, seq, data_rank, args.warmup + args.steps)
        stats = acc.has("memory_stats")
        acc.synchronize()
        before = acc.memory_allocated() if stats else 0
        if stats:
            acc.reset_peak_memory_stats()
        times, losses = [], []
        for i, ids in enumerate(steps):
            inputs = {"input_ids": ids, "labels": ids}
            if sp > 1:
                inputs = split_batch(inputs, rank=sp_rank, size=sp)
            inputs = {k: v.to(device) for k, v in inputs.items()}
            acc.synchronize()
            t0 = time.perf_counter()
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            acc.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            whole = loss.detach().float().reshape(1)
            if sp > 1:  # the sequence group's losses add up to the whole sequence's
                comm.all_reduce(whole, group=mesh.group("sequence"))
            losses.append(float(whole))
        peak = acc.max_memory_allocated() if stats else None
    finally:
        engine.destroy()
        engine = None
        gc.collect()
        acc.empty_cache()
    step_s = statistics.median(times)
    return {"sp": sp, "seq": seq, "data": world // sp, "step_ms": step_s * 1e3,
            "tokens_per_s": (world // sp) * args.batch * seq / step_s, "peak_gib": None if peak is None else
            peak / 2**30, "before_gib": before / 2**30, "first_loss": losses[0], "last_loss": losses[-1]}


def gather_row(row: dict, args, device) -> dict:
    """The row over every rank: the slowest rank's step time (tokens/s to match) and the largest peak."""
    from polyaccel import comm

    t = torch.tensor([row["step_ms"], row["peak_gib"] or 0.0, row["before_gib"]], dtype=torch.float64,
                     device=device)
    comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    step_ms = float(t[0])
    return {**row, "step_ms": step_ms, "tokens_per_s": row["data"] * args.batch * row["seq"] / (step_ms / 1e3),
            "peak_gib": None if row["peak_gib"] is None else float(t[1]), "before_gib": float(t[2])}


def print_table(rows: list[dict], args, world: int, device_name: str) -> None:
    shape = SIZES[args.size]
    print(f"\nAutoSP: Llama {shape['layers']}x{shape['hidden']} ({args.size}), ZeRO stage 3, {args.dtype}, "
          f"{world} ranks on {device_name}, batch {args.batch} per data rank")
    print(f"{'seq':>7s} {'sp':>3s} {'data':>5s} {'step ms':>9s} {'tokens/s':>11s} {'vs sp 1':>8s} "
          f"{'peak GiB':>9s} {'peak-before':>11s} {'vs sp 1':>8s} {'loss first -> last':>22s}")
    base = {r["seq"]: r for r in rows if r["sp"] == 1 and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['seq']:7d} {r['sp']:3d} {'':5s} {r['error']}")
            continue
        b = base.get(r["seq"])
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:8.2f}" if b else f"{'-':>8s}"
        if r["peak_gib"] is None:
            peak, work, mem = f"{'-':>9s}", f"{'-':>11s}", f"{'-':>8s}"
        else:
            peak, work = f"{r['peak_gib']:9.2f}", f"{r['peak_gib'] - r['before_gib']:11.2f}"
            base_work = b["peak_gib"] - b["before_gib"] if b and b["peak_gib"] is not None else None
            mem = f"{(r['peak_gib'] - r['before_gib']) / base_work:8.2f}" if base_work else f"{'-':>8s}"
        print(f"{r['seq']:7d} {r['sp']:3d} {r['data']:5d} {r['step_ms']:9.1f} {r['tokens_per_s']:11.0f} {speed} "
              f"{peak} {work} {mem} {r['first_loss']:10.4f} -> {r['last_loss']:.4f}")


def _write_json(path: str | None, rows: list[dict], args, world: int, device_name: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "world": world, "device": device_name,
                       "rows": rows}, f, indent=1)


def _spawn_smoke(argv: list[str]) -> int:
    """``--smoke`` started without torchrun: 2 CPU ranks through torch's launcher, on the cpu plugin."""
    env = {**os.environ, "POLYACCEL_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(SMOKE_RANKS),
           os.path.abspath(__file__), *argv]
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        if args.smoke:
            check_layout(args, SMOKE_RANKS, None, heads_of(args))
            return _spawn_smoke(list(argv if argv is not None else sys.argv[1:]))
        raise SystemExit("autosp_gpu.py runs under torchrun, one rank per GPU: torchrun --nproc-per-node N "
                         "benchmarks/autosp_gpu.py ... (or --smoke for a CPU check)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import polyaccel
    from polyaccel import comm

    acc = polyaccel.get_accelerator()
    world = int(os.environ["WORLD_SIZE"])
    devices = acc.device_count() if acc.device_type != "cpu" else None
    check_layout(args, world, devices, heads_of(args))  # every rank refuses alike, before the process group
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_type != "cpu":
        acc.set_device(local)
    device = acc.device(local)
    comm.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    rank = comm.get_rank()
    device_name = torch.cuda.get_device_name(local) if device.type == "cuda" else f"{acc.name} ({device.type})"
    rows: list[dict] = []
    try:
        for sp in sorted(args.sp_list):
            for seq in args.seq_list:
                try:
                    row = gather_row(run_row(args, sp, seq, acc, device), args, device)
                except torch.OutOfMemoryError:
                    row = {"sp": sp, "seq": seq, "error": "OOM (longer sequences at this sp skipped)"}
                    acc.empty_cache()
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    _write_json(args.json, rows, args, world, device_name)
                if "error" in row:
                    break
        if rank == 0:
            print_table(rows, args, world, device_name)
    finally:
        comm.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
