"""The largest batch x sequence each system trains on one GPU at vocabulary 128k (issue 46's fit row).

    python benchmarks/kernels_fit.py [--systems hf,liger,polyaccel,polyaccel+kernels] [--seq 4096] [--out f.json]
    python benchmarks/kernels_fit.py --smoke     # a tiny ladder on the CPU (checks the script runs)

Model: a Llama of 16 layers x 2048 hidden (heads of 64, GQA 4:1, intermediate 8192) with the Llama-3
vocabulary of 128256 and an untied LM head: 1.5B parameters, whose logits at 8 x 4096 tokens already take
4 GB in bf16 and 8 GB again in fp32. Every system trains it with bf16 autocast over fp32 weights, AdamW
and Hugging Face's activation checkpointing (non-reentrant), so what differs is the loss and the kernels:

- ``hf``: Hugging Face's model and loss, torch's fused AdamW (the logits and their fp32 copy);
- ``liger``: the same after ``apply_liger_kernel_to_llama`` (RoPE, RMSNorm, SwiGLU, fused linear CE);
- ``polyaccel``: ``polyaccel.initialize`` with ZeRO stage 1 (world 1), no model kernels;
- ``polyaccel+kernels``: the same with ``"kernels"`` all on (docs/model-kernels.md).

The ladder doubles the batch at ``--seq`` tokens a row from ``--start`` while a step passes, then
bisects once between the last pass and the first failure. A trial is one optimizer step (forward,
backward, step) in this process; a device OOM is a failure, after which the trial's memory is freed.
Each system runs in its own process (Liger patches Hugging Face's classes process-wide). Printed: per
trial pass/fail and the device peak; then per system the largest tokens a step and its ratio to ``hf``'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch
from zero_kernels import KERNELS, apply_liger
from zero_peers import optimizer_step

SYSTEMS = ("hf", "liger", "polyaccel", "polyaccel+kernels")
VOCAB = 128256


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # 5.17 (on the lent GPUs) has only the older one
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def make_step(system: str, model, device):
    """(step(ids) -> loss, close()) for ``system`` on ``model``."""
    if system.startswith("polyaccel"):
        import polyaccel

        config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
        if system.endswith("+kernels"):
            config["kernels"] = dict(KERNELS)
        engine = polyaccel.initialize(model, config)
        if "kernels" in config and not getattr(make_step, "plan_shown", False):
            from polyaccel.parallel import get_plan

            print(str(get_plan(model, "kernels")).split("\nswapped:")[0], flush=True)  # the per-kernel counts
            make_step.plan_shown = True

        def zero_step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return zero_step, engine.destroy
    if system == "liger":
        apply_liger(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    return optimizer_step(model, opt, device), lambda: None


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def trial(system: str, args, batch: int) -> dict:
    """One optimizer step at ``batch`` x ``args.seq``: {"batch", "tokens", "ok", "peak_gib", "s", "why"}."""
    device = torch.device(args.device)
    row = {"batch": batch, "tokens": batch * args.seq, "ok": False, "peak_gib": None, "s": None, "why": ""}
    step = close = None
    try:
        model = build(args)
        step, close = make_step(system, model, device)
        ids = torch.randint(0, args.vocab, (batch, args.seq), generator=torch.Generator().manual_seed(batch))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = float(step(ids.to(device)))
        row["s"] = round(time.perf_counter() - t0, 2)
        if loss != loss or loss in (float("inf"), float("-inf")):
            row["why"] = f"non-finite loss {loss}"
        else:
            row["ok"] = True
        if device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except Exception as exc:  # noqa: BLE001 - an OOM (or any error) is this trial's failure, not the run's
        row["why"] = "device OOM" if is_oom(exc) else f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    finally:
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - a close after an OOM may fail too; the memory is freed below
                pass
        step = close = model = None  # noqa: F841 - drop the references before collecting
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{system:18s} batch {batch:4d} x {args.seq}: {'pass' if row['ok'] else 'FAIL':4s} "
          f"peak {row['peak_gib']} GiB  {row['s']} s  {row['why']}", flush=True)
    return row


def ladder(system: str, args) -> dict:
    """Double the batch from ``args.start`` while steps pass (up to ``args.max_batch``), then bisect once."""
    trials, batch, good, bad = [], args.start, None, None
    while batch <= args.max_batch:
        row = trial(system, args, batch)
        trials.append(row)
        if not row["ok"]:
            bad = batch
            break
        good, batch = batch, batch * 2
    if good is not None and bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        row = trial(system, args, mid)
        trials.append(row)
        good = mid if row["ok"] else good
    return {"system": system, "largest_batch": good, "largest_tokens": (good or 0) * args.seq,
            "capped": bad is None, "trials": trials}


def run_system_process(system: str, argv: list[str]) -> dict:
    """``ladder(system)`` in a child process (its own CUDA context and, for Liger, its own patched classes)."""
    out = subprocess.run([sys.executable, __file__, *argv, "--child", system], capture_output=True, text=True)
    sys.stdout.write(out.stdout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"system": system, "largest_batch": None, "largest_tokens": 0, "capped": False, "trials": [],
            "error": (out.stderr.strip().splitlines() or ["no result"])[-1][:300]}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--seq", type=int, default=4096, help="tokens a row (the ladder scales the batch)")
    p.add_argument("--start", type=int, default=2, help="the ladder's first batch")
    p.add_argument("--max-batch", type=int, default=128, help="the ladder stops here (reported as capped)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--out", help="write the ladders as JSON")
    p.add_argument("--smoke", action="store_true", help="a tiny model and ladder on the CPU")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    if args.smoke:
        args.layers, args.hidden, args.vocab, args.seq, args.start, args.max_batch = 2, 64, 512, 16, 1, 2
        args.device = "cpu"
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (use --smoke on the CPU)")
        args.device = "cuda"
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.child:
        print("RESULT " + json.dumps(ladder(args.child, args)), flush=True)
        return 0
    systems = args.systems.split(",")
    if args.smoke and "liger" in systems:
        systems.remove("liger")  # Liger's kernels need a GPU
    results = [run_system_process(s, argv) for s in systems]
    base = next((r["largest_tokens"] for r in results if r["system"] == "hf"), 0)
    print(f"\nlargest tokens a step (batch x {args.seq}), vocab {args.vocab}, {args.layers}x{args.hidden} Llama:")
    for r in results:
        ratio = f"{r['largest_tokens'] / base:5.2f}x hf" if base else ""
        cap = " (capped: the ladder's top passed)" if r.get("capped") else ""
        err = f"  error: {r['error']}" if r.get("error") else ""
        print(f"  {r['system']:18s} {r['largest_tokens']:8d} tokens (batch {r['largest_batch']})  {ratio}{cap}{err}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
