"""ZeRO stages 2 and 3: polyaccel vs DeepSpeed on CPU, 2 ranks over gloo, same model, seed and config.

Each framework is launched with torchrun (``python -m torch.distributed.run --standalone``) as its
own subprocess, one after the other, from this one invocation; both train the same HF Llama
(built from a config, identical initial weights from the same seed) on the same batches with
the same AdamW / clipping config. The driver prints, per stage, the largest per-step loss
difference (parity) and the median step time of each framework with the ratio
``deepspeed / polyaccel`` (above 1: polyaccel is faster; the target is >= 1).

DeepSpeed lives only in its own virtual environment, never in polyaccel's. Set-up (once), in a
per-user folder (not the shared temp dir, where another local user could plant the interpreter
this script runs):

    python3.11 -m venv ~/.cache/polyaccel/deepspeed-venv
    ~/.cache/polyaccel/deepspeed-venv/bin/pip install -c constraints.txt torch==2.13.0+cpu transformers==5.24.0
    DS_BUILD_OPS=0 ~/.cache/polyaccel/deepspeed-venv/bin/pip install -c constraints.txt deepspeed==0.19.8

(``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set; ``--ds-python`` names another interpreter.)

(``DS_BUILD_OPS=0``: no ops are compiled at install time; DeepSpeed JIT-builds its CPU Adam op
into ``~/.cache/torch_extensions`` on first use, about a minute once. The first DeepSpeed run
of a stage is therefore preceded by an untimed warm-up launch when ``--warmup-ds`` is given.)

Run from the repository root, in polyaccel's environment:

    python benchmarks/zero_vs_deepspeed.py                       # stages 2 and 3
    python benchmarks/zero_vs_deepspeed.py --stages 3 --offload  # with optimizer (+ param) offload
    python benchmarks/zero_vs_deepspeed.py --ds-python /path/to/venv/bin/python --json-out r.json

Internally the same file is the rank program (``--worker polyaccel|deepspeed``); the two
workers share the model, data and config builders below and differ only in the engine call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _default_ds_python() -> str:
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "polyaccel", "deepspeed-venv", "bin", "python")


DEFAULT_DS_PYTHON = _default_ds_python()

# ------------------------------------------------------------------ shared by both workers


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq_len, attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )


def build_model(args):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(model_config(args))
    model.train()
    return model


def engine_config(args) -> dict:
    """One DeepSpeed-style config, read by both engines."""
    zero: dict = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def batch(args, step: int, rank: int, world: int):
    """A learnable token stream: arithmetic progressions mod vocab, random start and stride per row."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    n = world * args.batch_size
    start = torch.randint(0, args.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(args.seq_len)[None, :]) % args.vocab
    return ids[rank * args.batch_size:(rank + 1) * args.batch_size]


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    config = engine_config(args)
    if args.worker == "polyaccel":
        import polyaccel
        from polyaccel import comm

        comm.init_distributed()
        engine = polyaccel.initialize(model, config=config)
        version = f"polyaccel {polyaccel.__version__}"
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        version = f"deepspeed {deepspeed.__version__}"
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, times, phases = [], [], {"forward": [], "backward": [], "step": []}
    for step in range(args.steps):
        ids = batch(args, step, rank, world)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        engine.backward(loss)  # includes the gradient reduction both engines run from backward hooks
        t2 = time.perf_counter()
        engine.step()  # optimizer on the partition, then the parameter all-gather (stage 2)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        for key, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            phases[key].append(dt)
        reported = loss.detach().double().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
    if hasattr(engine, "destroy"):
        engine.destroy()
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "framework": args.worker, "version": version, "torch": torch.__version__, "params": n_params,
            "world_size": world, "losses": losses, "step_times_s": times, "phase_times_s": phases,
        }))
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def _launch(python: str, args, framework: str, stage: int, out: Path, log: Path) -> dict:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           __file__, "--worker", framework, "--stage", str(stage), "--out", str(out)]
    for flag in ("steps", "batch_size", "seq_len", "hidden", "layers", "heads", "vocab", "lr", "seed", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.offload:
        cmd.append("--offload")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads), TRANSFORMERS_VERBOSITY="error")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{framework} stage {stage} failed (rc={rc}); last lines of {log}:\n{tail}")
    result = json.loads(out.read_text())
    result["launch_wall_s"] = time.perf_counter() - t0
    return result


def _median_ms(times: list[float], skip: int) -> float:
    kept = times[skip:] if len(times) > skip else times
    return 1000 * statistics.median(kept)


def _min_ms(times: list[float], skip: int) -> float:
    kept = times[skip:] if len(times) > skip else times
    return 1000 * min(kept)


def run_driver(args) -> int:
    if not Path(args.ds_python).exists():
        print(f"DeepSpeed's python {args.ds_python} not found; set it up as this script's docstring says "
              "or pass --ds-python", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero_vs_ds_") as tmp:
        tmp = Path(tmp)
        for stage in args.stages:
            if args.warmup_ds:  # builds/loads DeepSpeed's JIT ops outside the measured launch
                _launch(args.ds_python, argparse.Namespace(**{**vars(args), "steps": 1}), "deepspeed", stage,
                        tmp / "warm.json", tmp / "warm.log")
            runs: dict[str, list[dict]] = {"polyaccel": [], "deepspeed": []}
            for i in range(args.repeat):  # interleaved, alternating who goes first, so drift hits both
                for fw in (("polyaccel", "deepspeed") if i % 2 == 0 else ("deepspeed", "polyaccel")):
                    py = sys.executable if fw == "polyaccel" else args.ds_python
                    runs[fw].append(_launch(py, args, fw, stage, tmp / f"{fw}{stage}_{i}.json",
                                            tmp / f"{fw}{stage}_{i}.log"))
            res = {}
            for fw, rs in runs.items():
                med = [_median_ms(r["step_times_s"], args.skip) for r in rs]
                phase = {k: statistics.median(_median_ms(r["phase_times_s"][k], args.skip) for r in rs)
                         for k in ("forward", "backward", "step")}
                res[fw] = rs[0] | {"median_ms_runs": med, "median_ms": statistics.median(med),
                                   "min_ms": min(_min_ms(r["step_times_s"], args.skip) for r in rs),
                                   "phase_median_ms": phase}
            pa, ds = res["polyaccel"], res["deepspeed"]
            diffs = [abs(a - b) for a, b in zip(pa["losses"], ds["losses"], strict=True)]
            rows.append({
                "stage": stage, "offload": args.offload, "params": pa["params"], "steps": args.steps,
                "loss_first": pa["losses"][0], "loss_last_polyaccel": pa["losses"][-1],
                "loss_last_deepspeed": ds["losses"][-1], "max_abs_loss_diff": max(diffs),
                "polyaccel_ms": pa["median_ms"], "deepspeed_ms": ds["median_ms"],
                "polyaccel_ms_runs": pa["median_ms_runs"], "deepspeed_ms_runs": ds["median_ms_runs"],
                "ratio_ds_over_polyaccel": ds["median_ms"] / pa["median_ms"],
                # the least-disturbed launch of each: on a shared host, contention only ever adds time
                "ratio_best_launch": min(ds["median_ms_runs"]) / min(pa["median_ms_runs"]),
                # the fastest single step of all launches: the least-disturbed estimate of each framework's cost
                "polyaccel_min_ms": pa["min_ms"], "deepspeed_min_ms": ds["min_ms"],
                "ratio_min_step": ds["min_ms"] / pa["min_ms"],
                "phase_median_ms": {"polyaccel": pa["phase_median_ms"], "deepspeed": ds["phase_median_ms"]},
                "versions": [pa["version"], ds["version"], f"torch {pa['torch']} / {ds['torch']}"],
            })
    print(f"\nZeRO on CPU, {args.nproc} ranks (gloo, {args.threads} thread(s) each), "
          f"Llama {rows[0]['params']:,} params, "
          f"batch {args.batch_size}x{args.seq_len} per rank, {args.steps} steps (median step time after {args.skip}, "
          f"median of {args.repeat} launch(es)), offload={'on' if args.offload else 'off'}")
    print(f"{rows[0]['versions']}")
    print(f"{'stage':>5} {'loss 0 -> last (polyaccel | deepspeed)':>42} {'max |dloss|':>12} "
          f"{'polyaccel ms':>13} {'deepspeed ms':>13} {'ds/polyaccel':>13} {'best launches':>14}")
    for r in rows:
        print(f"{r['stage']:>5} {r['loss_first']:>10.4f} -> {r['loss_last_polyaccel']:.4f} | "
              f"{r['loss_last_deepspeed']:.4f}"
              f"{'':>6} {r['max_abs_loss_diff']:>12.2e} {r['polyaccel_ms']:>13.1f} {r['deepspeed_ms']:>13.1f} "
              f"{r['ratio_ds_over_polyaccel']:>12.2f}x {r['ratio_best_launch']:>13.2f}x")
    print("ds/polyaccel > 1: polyaccel is faster. 'best launches' compares each framework's fastest launch.")
    print(f"\n{'stage':>5} {'fastest step ms (polyaccel | deepspeed)':>40} {'ratio':>7}   "
          "median phases ms, forward / backward (+reduction) / step (+all-gather)")
    for r in rows:
        ph = r["phase_median_ms"]
        pa_ph = " / ".join(f"{v:.1f}" for v in ph["polyaccel"].values())
        ds_ph = " / ".join(f"{v:.1f}" for v in ph["deepspeed"].values())
        print(f"{r['stage']:>5} {r['polyaccel_min_ms']:>25.1f} | {r['deepspeed_min_ms']:<12.1f} "
              f"{r['ratio_min_step']:>6.2f}x   polyaccel {pa_ph}; deepspeed {ds_ph}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("polyaccel", "deepspeed"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(1, 2, 3))
    p.add_argument("--offload", action="store_true", help="offload optimizer (and params at stage 3) to cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    p.add_argument("--repeat", type=int, default=1, help="launches per framework and stage")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--warmup-ds", action="store_true", help="one untimed DeepSpeed launch per stage first")
    p.add_argument("--ds-python", default=DEFAULT_DS_PYTHON, help=f"DeepSpeed's venv python ({DEFAULT_DS_PYTHON})")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
