"""The README's "Using it" snippet under ``torchrun --nproc-per-node 4``, N times: does any rank abort at exit?

    python benchmarks/teardown_stress.py                  # 100 runs, gloo on the cpu plugin
    python benchmarks/teardown_stress.py --runs 40 --minutes 10 --steps 1

Each run is ``torchrun --standalone --nproc-per-node 4 teardown_stress.py --rank`` (``--rank`` runs the
snippet on a tiny Qwen3-MoE, the model the snippet leaves to the reader, with ZeRO 2 x AutoTP 2 x AutoEP 2;
``--steps`` adds training steps before the exit; ``--without-teardown`` switches off polyaccel's exit
teardown in the ranks, the way it was before, for a baseline rate). A run counts as an abort when torchrun
reports a rank ended by SIGABRT (or any signal), as a failure when it exits non-zero, and as unclean when a rank printed
a traceback or torch's warning about a process group left alive. The logs of every bad run are kept.
Prints one line per bad run and a summary; exit status 1 when any run was bad.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

SIGNAL_DEATH = re.compile(r"exitcode\s*:\s*-(\d+)|Signal (\d+) \((SIG\w+)\)")


def rank_main(steps: int, without_teardown: bool) -> None:
    import polyaccel
    import torch
    import transformers
    from polyaccel.comm import teardown
    from polyaccel.engines.autoep.models import build_tiny

    if without_teardown:
        teardown.arm = lambda: None  # the group is left to interpreter shutdown, as before the exit teardown

    transformers.logging.set_verbosity_error()
    model = build_tiny("qwen3_moe", torch.float32, seed=0, vocab=64, hidden=32, experts=4, ffn=16,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    # --- the README's "Using it" snippet ---
    acc = polyaccel.get_accelerator()
    print(acc.name, acc.capabilities())
    opt = polyaccel.optim.FusedAdam(model.parameters(), lr=1e-3)
    print(polyaccel.ops.explain("fused_adam"))
    engine = polyaccel.initialize(model, {
        "zero_optimization": {"stage": 2},
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    })
    # --- end of the snippet ---
    del opt
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()


def classify(rc: int, text: str) -> str | None:
    """None for a clean run, else what went wrong."""
    deaths = [m.group(3) or f"signal {m.group(1)}" for m in SIGNAL_DEATH.finditer(text)]
    if any(d in ("SIGABRT", "signal 6") for d in deaths):
        return f"abort (rc {rc}; {', '.join(deaths)})"
    if deaths:
        return f"a rank killed by a signal (rc {rc}; {', '.join(deaths)})"
    if rc != 0:
        return f"exit status {rc}"
    if "Traceback" in text or "destroy_process_group" in text:
        return "a traceback or a process-group warning in the output"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="training steps after the snippet (0: the snippet alone)")
    ap.add_argument("--without-teardown", action="store_true", help="baseline: no exit teardown in the ranks")
    ap.add_argument("--minutes", type=float, default=None, help="stop starting runs after this long")
    ap.add_argument("--logs", default=None, help="folder for the logs of bad runs (default: a temporary one)")
    args = ap.parse_args()
    if args.rank:
        rank_main(args.steps, args.without_teardown)
        return 0

    logs = args.logs or tempfile.mkdtemp(prefix="teardown-stress-")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, POLYACCEL_ACCELERATOR=os.environ.get("POLYACCEL_ACCELERATOR", "cpu"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--rank", f"--steps={args.steps}"]
    if args.without_teardown:
        cmd.append("--without-teardown")
    print("each run:", " ".join(cmd[2:]), flush=True)
    start = time.monotonic()
    done, bad, aborts = 0, 0, 0
    for run in range(args.runs):
        if args.minutes is not None and time.monotonic() - start > args.minutes * 60:
            break
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done += 1
        what = classify(r.returncode, r.stdout)
        if what is not None:
            bad += 1
            aborts += what.startswith("abort")
            path = os.path.join(logs, f"run{run:03d}.log")
            with open(path, "w") as f:
                f.write(r.stdout)
            print(f"run {run}: {what}; log {path}", flush=True)
    minutes = (time.monotonic() - start) / 60
    print(f"{done} runs of {args.nproc} ranks in {minutes:.1f} min: {aborts} aborts, {bad} bad runs in all "
          f"(steps {args.steps}{', without the exit teardown' if args.without_teardown else ''})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
