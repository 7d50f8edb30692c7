"""The largest Llama-shaped model each system can train on one GPU with parameters and optimizer offloaded.

    python benchmarks/zero_largest.py [--systems polyaccel,fsdp2,deepspeed] [--hidden 4096] [--budget 230]
    python benchmarks/zero_largest.py --quick          # a tiny ladder on the CPU (the test's run)

Systems: polyaccel ZeRO stage 3 + offload_param + offload_optimizer; torch FSDP2 + CPUOffloadPolicy
(pinned); DeepSpeed ZeRO-3 with offload_param and offload_optimizer (pinned). Every one trains a
Llama shape (``--hidden``, heads of 64, intermediate 11/4 of hidden, vocab 32000) in bf16 with Hugging
Face's activation checkpointing (non-reentrant) on batch ``--batch`` x ``--seq`` (1 x 2048) with AdamW.

The ladder is the number of decoder layers at a fixed hidden size. Each trial runs in its own process
under a timeout, watched from here: a device OOM, a host OOM (the host's available memory falling under
``--host-margin-gib``, the child killed by the kernel, or a failed pinned allocation), a timeout, a non-
finite loss or any other error is a failure (printed with its reason). The search starts at 90% of the
smallest layer count the systems' host bytes per parameter predict (``HOST_BYTES``: what each keeps on
the host), the same rung for all, then per system steps up while trials pass, doubling the step, down
when they fail, then bisects to ``--resolution`` layers, and stops where the device-time ``--budget``
(shared by the systems) runs out, reporting the bracket it reached. Printed: per trial the layers,
parameters, pass/fail and why, step time, host peak (the child's peak resident set, VmHWM, sampled) and
device peak; then the largest size per system and every system's step time at the largest size all of
them trained (a trial of its own where the search did not run that size). ``--out`` writes it all as
JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field

SYSTEMS = ("polyaccel", "fsdp2", "deepspeed")
#: bytes per parameter each system keeps on the host (offloaded parameters and optimizer, bf16 training):
#: polyaccel: fp32 master 4 + Adam 8 + bf16 gradient 2 (fp32, 4, where it accumulates or a clipped step scales
#: it) + the bf16 parameter's host home 2;
#: FSDP2 + CPUOffloadPolicy: fp32 sharded parameter 4 (its master) + fp32 gradient 4 + Adam 8;
#: DeepSpeed ZeRO-3 offload: bf16 parameter 2 + fp32 master 4 + Adam 8 + fp32 gradient 4.
HOST_BYTES = {"polyaccel": 16, "fsdp2": 16, "deepspeed": 18}
VOCAB = 32000


def llama_params(layers: int, hidden: int) -> int:
    """Parameters of the Llama shape: attention 4 h^2, MLP 3 h i, two norms per layer, embeddings and head."""
    inter = hidden * 11 // 4
    return layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + 2 * VOCAB * hidden + hidden


def predicted_layers(system: str, hidden: int, host_bytes: float) -> int:
    """Layers whose host state fits ``host_bytes`` at ``HOST_BYTES[system]`` per parameter (at least 1)."""
    per_layer = llama_params(1, hidden) - llama_params(0, hidden)
    return max(1, int((host_bytes / HOST_BYTES[system] - llama_params(0, hidden)) // per_layer))


class _BudgetOut(Exception):
    """A trial was cut short by the end of the budget, not by its own timeout."""


@dataclass
class Trial:
    system: str
    layers: int
    params: int
    ok: bool
    why: str = ""
    step_ms: float | None = None
    host_peak_gib: float | None = None
    device_peak_gib: float | None = None
    wall_s: float = 0.0
    losses: list = field(default_factory=list)


def search(trial, start: int, resolution: int = 1, max_layers: int | None = None, out_of_time=lambda: False):
    """Largest passing layer count by ``trial(layers) -> bool``: from ``start`` step up while trials pass
    and down while they fail, doubling the step each time, then bisect the bracket down to
    ``resolution``. Returns ``(largest pass or 0, smallest fail or None)``; stops early when
    ``out_of_time()``. ``max_layers`` caps the ladder (a pass there ends the search)."""
    good, bad = 0, None
    step = resolution
    layers = max(1, start if max_layers is None else min(start, max_layers))
    while not out_of_time():
        if trial(layers):
            good = layers
            if max_layers is not None and layers >= max_layers:
                return good, bad
            if bad is not None:
                break
            layers += step
            if max_layers is not None:
                layers = min(layers, max_layers)
        else:
            bad = layers
            if good or layers == 1:
                break
            layers = max(1, layers - step)
        step *= 2
    while bad is not None and bad - good > resolution and not out_of_time():
        mid = (good + bad) // 2
        if trial(mid):
            good = mid
        else:
            bad = mid
    return good, bad


# ------------------------------------------------------------------------------------------- child side
def build_model(layers: int, hidden: int, seq: int, dtype):
    """The Llama model on the host in ``dtype``, built on the meta device and filled in place: norms 1, every
    other parameter from one pool of normal(0, 0.02) values, tiled at an offset that moves per parameter.
    A pool costs one random draw of 2**22 values; drawing each of billions of parameters took minutes of a
    trial's time. The values only need the scale of a real initialisation, so the loss stays finite."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 64), max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    pool = torch.empty(1 << 22).normal_(0.0, 0.02, generator=gen).to(dtype)
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            flat, shift = p.view(-1), (k * 7919) % pool.numel()
            rolled = torch.cat([pool[shift:], pool[:shift]])
            for lo in range(0, flat.numel(), rolled.numel()):
                part = flat[lo:lo + rolled.numel()]
                part.copy_(rolled[:part.numel()])
        fresh = type(model.model.rotary_emb)(config=cfg)  # the rotary frequencies, left empty by to_empty
        for name, b in fresh.named_buffers():
            getattr(model.model.rotary_emb, name).copy_(b)
    model.config.use_cache = False
    with warnings.catch_warnings():  # newer transformers rename it; the old name works in every version
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _polyaccel_step(model, args):
    import polyaccel

    config = {"bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    engine = polyaccel.initialize(model, config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _deepspeed_step(model, args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zero_peers import deepspeed_step

    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    step, _close = deepspeed_step(model, zero, args.batch, 1e-4, 0.01)
    return step


def _fsdp2_step(model, args, device):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zero_peers import optimizer_step

    if device.type != "cuda":
        raise RuntimeError("skipped: FSDP2's CPUOffloadPolicy needs a CUDA device")
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "offload_policy": CPUOffloadPolicy(pin_memory=True), "reshard_after_forward": True}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return optimizer_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01))


PHASE = "[trial] phase "


def _phase(name: str, t0: float) -> None:
    """Tell the parent where the trial is (a timeout then names the phase it cut short)."""
    print(f"{PHASE}{name} at {time.monotonic() - t0:.0f} s", flush=True)


def child(args) -> int:
    """One trial: build, train ``--steps`` steps, write the result JSON (the parent reads host memory)."""
    import resource

    import torch

    result = {"ok": False, "why": ""}
    t_start = time.monotonic()

    def write():
        result["ru_maxrss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        with open(args.out, "w") as f:
            json.dump(result, f)

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29600 + os.getpid() % 300))):
        os.environ.setdefault(key, value)
    acc, has_mem = None, False
    try:
        import polyaccel
        import polyaccel.comm

        polyaccel.comm.init_distributed(init_method="env://", rank=0, world_size=1)
        acc = polyaccel.get_accelerator()
        device, sync = acc.device(), acc.synchronize
        has_mem = acc.has("memory_stats")
        dtype = torch.float32 if args.child == "fsdp2" else torch.bfloat16  # FSDP2's sharded params are its master
        make = {"polyaccel": _polyaccel_step, "deepspeed": _deepspeed_step,
                "fsdp2": lambda m, a: _fsdp2_step(m, a, device)}[args.child]
        _phase("build", t_start)
        model = build_model(args.layers, args.hidden, args.seq, dtype)
        _phase("initialize", t_start)
        step = make(model, args)
        gen = torch.Generator().manual_seed(1)
        times, losses = [], []
        for k in range(args.steps):
            _phase(f"step {k + 1} of {args.steps}", t_start)
            ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=gen).to(device)
            sync()
            t0 = time.perf_counter()
            loss = float(step(ids))
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss {loss}")
        timed = sorted(times[1:] or times)  # the first step sets up lazily: not timed when there are more
        result.update(ok=True, step_ms=timed[len(timed) // 2] * 1e3, losses=losses,
                      device_peak_gib=acc.max_memory_allocated() / 2**30 if has_mem else None)
    except Exception as exc:  # noqa: BLE001 - every failure is a result of the trial, with its reason
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        low = msg.lower()
        if msg.startswith("RuntimeError: skipped:") or "not importable" in low or "no module named" in low:
            result["why"] = "skipped: " + msg.split("skipped: ")[-1]
        elif "out of memory" in low and ("cuda" in low or "device" in low or "gpu" in low):
            # a refused page-locked host allocation raises the same CUDA error as a full device: tell them apart
            # by how much of the device was in use
            used = acc.max_memory_allocated() / acc.total_memory() if has_mem else 1.0
            result["why"] = (f"device OOM: {msg}" if used > 0.5 else
                             f"host OOM (a pinned allocation, device peak {used:.0%} of its memory): {msg}")
        elif "out of memory" in low or "cannot allocate memory" in low or "hostalloc" in low:
            result["why"] = f"host OOM: {msg}"
        else:
            result["why"] = f"error: {msg}"
    write()
    return 0


# ------------------------------------------------------------------------------------------ parent side
def mem_available() -> int | None:
    """The host's MemAvailable in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def vm_hwm(pid: int) -> int | None:
    """A process's peak resident set (VmHWM) in bytes, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_trial(args, system: str, layers: int) -> Trial:
    """One child process for ``system`` at ``layers``, watched for host memory and time."""
    params = llama_params(layers, args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trial.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--layers", str(layers),
               "--hidden", str(args.hidden), "--seq", str(args.seq), "--batch", str(args.batch),
               "--steps", str(args.steps), "--out", out]
        t0 = time.monotonic()
        # the child's output goes to a file: a pipe nobody reads fills up under a chatty system's logging and
        # stalls the child until its timeout
        log = open(os.path.join(tmp, "trial.log"), "w+")  # noqa: SIM115 - closed after the child is done
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:  # the kernel's OOM killer should take the trial, not this process
            with open(f"/proc/{proc.pid}/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        killed, peak = "", 0
        margin = args.host_margin_gib * 2**30
        while proc.poll() is None:
            peak = max(peak, vm_hwm(proc.pid) or 0)
            avail = mem_available()
            if avail is not None and avail < margin:
                killed = (f"host OOM: available host memory fell to {avail / 2**30:.1f} GiB "
                          f"(margin {args.host_margin_gib} GiB)")
            elif time.monotonic() - t0 > args.trial_timeout:
                killed = f"timeout after {args.trial_timeout:.0f} s"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        proc.wait()
        log.seek(0)
        tail = log.read()
        log.close()
        wall = time.monotonic() - t0
        phases = [line[len(PHASE):] for line in tail.splitlines() if line.startswith(PHASE)]
        if killed and phases:
            killed += f" (cut in {phases[-1]})"
        if killed:
            return Trial(system, layers, params, False, killed, host_peak_gib=peak / 2**30, wall_s=wall)
        if not os.path.exists(out):
            last = " | ".join(tail.strip().splitlines()[-2:])
            why = (f"host OOM: killed by signal {-proc.returncode}" if proc.returncode == -signal.SIGKILL
                   else f"error: exit {proc.returncode}: {last}")
            return Trial(system, layers, params, False, why, host_peak_gib=peak / 2**30, wall_s=wall)
        with open(out) as f:
            r = json.load(f)
    host = max(peak, int(r.get("ru_maxrss_gib", 0) * 2**30)) / 2**30
    return Trial(system, layers, params, bool(r["ok"]), r.get("why", ""), r.get("step_ms"), host,
                 r.get("device_peak_gib"), wall, r.get("losses", []))


def show(t: Trial) -> None:
    what = f"{t.step_ms:9.1f} ms/step" if t.ok else f"FAIL {t.why}"
    dev = f", device peak {t.device_peak_gib:.2f} GiB" if t.device_peak_gib is not None else ""
    host = f"host peak {t.host_peak_gib:.2f} GiB" if t.host_peak_gib is not None else "host peak ?"
    print(f"  {t.system:10s} {t.layers:4d} layers {t.params / 1e9:7.3f} B params: {what} ({host}{dev}; "
          f"{t.wall_s:.0f} s)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from " + ", ".join(SYSTEMS))
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size of every rung (default 4096)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="steps per trial; the first is not timed (default 2)")
    ap.add_argument("--start", type=int, default=None,
                    help="first rung in layers (default: predicted from the host's available memory)")
    ap.add_argument("--max-layers", type=int, default=None, help="top of the ladder (a pass there ends the search)")
    ap.add_argument("--resolution", type=int, default=2, help="bisect down to this many layers (default 2)")
    ap.add_argument("--budget", type=float, default=230.0, help="seconds for the whole search (default 230)")
    ap.add_argument("--trial-timeout", type=float, default=240.0,
                    help="seconds per trial (default 240; a 6B trial takes minutes to build, offload and step)")
    ap.add_argument("--host-margin-gib", type=float, default=3.0,
                    help="a trial fails (host OOM) when available host memory falls below this (default 3)")
    ap.add_argument("--quick", action="store_true", help="a tiny ladder on the CPU, polyaccel only (seconds)")
    ap.add_argument("--out", default=None, help="write trials and results as JSON here")
    ap.add_argument("--child", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args)
    if args.quick:
        args.hidden, args.seq, args.steps, args.resolution = 64, 32, 2, 1
        args.start = args.start or 1
        args.max_layers = args.max_layers or 3
        if args.systems == ",".join(SYSTEMS):
            args.systems = "polyaccel"
        os.environ.setdefault("POLYACCEL_ACCELERATOR", "cpu")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown} in --systems; choose from {', '.join(SYSTEMS)}")
    for name in ("steps", "resolution", "hidden", "seq", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hidden % 64:
        ap.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    avail = mem_available()
    print(f"host memory available {avail / 2**30:.1f} GiB" if avail else "host memory available: unknown", flush=True)
    t_end = time.monotonic() + args.budget

    def limited():
        """The arguments with the trial timeout cut to what is left of the budget (a trial never outlives it)."""
        return argparse.Namespace(**{**vars(args), "trial_timeout": max(1.0, min(args.trial_timeout,
                                                                               t_end - time.monotonic()))})
    trials: list[Trial] = []
    results = {}
    # one start for all (so a budget of one trial each still times every system at one size): 90% of the
    # smallest prediction, as a pass tells more than a fail when few trials fit
    host = (avail - args.host_margin_gib * 2**30) if avail else 0
    start = args.start or (max(1, int(0.9 * min(predicted_layers(s, args.hidden, host) for s in systems)))
                           if avail else 8)
    for i, system in enumerate(systems):
        share_end = time.monotonic() + (t_end - time.monotonic()) / (len(systems) - i)  # unused time passes on
        print(f"{system}: search from {start} layers (predicted limit {predicted_layers(system, args.hidden, host)} "
              f"at {HOST_BYTES[system]} host bytes/param)", flush=True)
        skipped = []

        def trial(layers, system=system, skipped=skipped):
            lim = limited()
            t = run_trial(lim, system, layers)
            if t.why.startswith("timeout") and lim.trial_timeout < args.trial_timeout:
                t.why = f"cut: the budget ran out after {t.wall_s:.0f} s (says nothing about this size)"
                show(t)
                raise _BudgetOut
            trials.append(t)
            show(t)
            if t.why.startswith("skipped"):
                skipped.append(t.why)
            return t.ok

        try:
            good, bad = search(trial, start, args.resolution, args.max_layers,
                               lambda skipped=skipped, end=share_end: bool(skipped) or time.monotonic() > end)
        except _BudgetOut:
            done = [t for t in trials if t.system == system]
            good = max((t.layers for t in done if t.ok), default=0)
            bad = min((t.layers for t in done if not t.ok and t.layers > good), default=None)
        results[system] = {"largest_layers": good, "largest_params": llama_params(good, args.hidden) if good else 0,
                           "smallest_failing_layers": bad, "skipped": skipped[0] if skipped else None}
    trained = [s for s in systems if results[s]["largest_layers"]]
    common = min((results[s]["largest_layers"] for s in trained), default=0)
    at_common = {}
    for s in trained:
        done = [t for t in trials if t.system == s and t.layers == common and t.ok]
        if not done and time.monotonic() < t_end - 5:
            t = run_trial(limited(), s, common)
            trials.append(t)
            show(t)
            done = [t] if t.ok else []
        at_common[s] = done[0].step_ms if done else None
    print(f"\nLlama x {args.hidden} hidden, batch {args.batch}x{args.seq}, bf16, activation checkpointing, "
          "parameters and optimizer offloaded")
    for s in systems:
        r = results[s]
        if r["skipped"]:
            print(f"  {s:10s} skipped ({r['skipped']})")
            continue
        bracket = f", fails at {r['smallest_failing_layers']}" if r["smallest_failing_layers"] else ", none failed"
        print(f"  {s:10s} largest trained: {r['largest_layers']} layers = {r['largest_params'] / 1e9:.3f} B params"
              f"{bracket}")
    if common:
        print(f"step time at {common} layers ({llama_params(common, args.hidden) / 1e9:.3f} B), the largest all "
              "trained: " + ", ".join(f"{s} {ms:.1f} ms" if ms else f"{s} ?" for s, ms in at_common.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "common_layers": common, "step_ms_at_common": at_common,
                       "trials": [asdict(t) for t in trials]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
