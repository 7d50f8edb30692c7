"""Train a small HF Llama (or GPT-2) with ZeRO over several ranks: polyaccel's main job.

Starts the ranks through torchrun's API (default: 2 ranks on the cpu plugin over gloo; on a
machine whose selected accelerator is a device, one rank per device), builds the model offline
from a config, trains it on bundled text (or --text FILE) with a byte-level tokenizer, shows a
progress bar with the loss and tokens/s, optionally saves and resumes checkpoints, and ends
with a summary naming the accelerator plugin, the comm backend and the op builders used.

Examples:
  polyaccel train                                  # defaults: about a minute on 2 CPU cores
  polyaccel train --stage 3 --offload --steps 20
  polyaccel train --steps 30 --save ckpt/          # checkpoint at step 30 in ckpt/
  polyaccel train --steps 60 --resume ckpt/        # continue from step 30 to 60
  polyaccel train --nproc 4 --tp 2                 # AutoTP over pairs of ranks, ZeRO over the 2 data ranks
  polyaccel train --nproc 4 --model mixtral --ep 2  # a small MoE, its 8 experts over pairs of ranks (AutoEP)
  polyaccel train --nproc 8 --model mixtral --tp 2 --ep 2  # both, with ZeRO over what is left (data 4)
  polyaccel train --sp 2 --nproc 2                 # AutoSP: each sequence split over 2 ranks (Ulysses attention)
  polyaccel train --init-from model.safetensors    # start from a plain HF state dict (e.g. zero-to-fp32's)
  polyaccel train --kernels all                    # the plugins' RMSNorm/RoPE/SwiGLU/fused loss (auto on GPUs)

Arguments are checked before any rank starts; a bad one is reported with the fix.
"""

from __future__ import annotations

import argparse
import os
import sys

HELP = "train a small HF Llama/GPT-2 with ZeRO across ranks (the main job)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .kernels import CHOICES as KERNEL_CHOICES
    from .model import MODELS, ModelSpec
    from .options import DEFAULT_LR, DTYPES, OPTIMIZERS, STAGES, TrainOptions

    d = TrainOptions()
    _run_arguments(parser.add_argument_group("run"), d)
    _model_arguments(parser.add_argument_group("model and data"), d, ModelSpec(), MODELS)
    g = parser.add_argument_group("optimisation")
    _layout_arguments(g, d, STAGES)
    _optimizer_arguments(g, d, DTYPES, OPTIMIZERS, KERNEL_CHOICES, DEFAULT_LR)
    _checkpoint_arguments(parser.add_argument_group("checkpoints"))


def _run_arguments(g, d) -> None:
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to start (default: 2 on the cpu plugin, else one per device)")
    g.add_argument("--accelerator", default=None, metavar="NAME",
                   help="accelerator plugin to use (default: the selected one; see `polyaccel report`)")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (default: host cores / ranks)")
    g.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights and data (default {d.seed})")
    g.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps to reach (default {d.steps})")
    g.add_argument("--log-every", type=int, default=0,
                   help="steps between log lines when output is not a terminal (default: steps/10)")
    g.add_argument("--metrics-out", default=None, metavar="FILE",
                   help="write the run's result (per-step losses, times, summary fields) as JSON")


def _model_arguments(g, d, m, models) -> None:
    g.add_argument("--model", choices=models, default=m.name, help=f"architecture (default {m.name})")
    g.add_argument("--hidden-size", type=int, default=m.hidden_size, help=f"default {m.hidden_size}")
    g.add_argument("--layers", type=int, default=m.num_layers, help=f"default {m.num_layers}")
    g.add_argument("--heads", type=int, default=m.num_heads, help=f"attention heads (default {m.num_heads})")
    g.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text to train on (default: bundled text)")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"sequences per rank per micro-step (default {d.batch_size})")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")


def _layout_arguments(g, d, stages) -> None:
    """Where the model and its optimizer state go: ZeRO stage, parallel degrees, graphs, offload."""
    g.add_argument("--stage", type=int, choices=stages, default=d.stage,
                   help=f"ZeRO stage (default {d.stage})")
    g.add_argument("--tp", type=int, default=d.tp, metavar="N",
                   help="tensor-parallel degree (AutoTP): ranks = data x tensor, N must divide them (default 1)")
    g.add_argument("--ep", type=int, default=d.ep, metavar="N",
                   help="expert parallelism for MoE models (--model mixtral): experts over N ranks (default 1)")
    g.add_argument("--sp", type=int, default=d.sp, metavar="S",
                   help="sequence-parallel degree (AutoSP, Ulysses attention): each sequence is split over S ranks "
                        "that get the same rows (ranks = data x sequence x tensor); S must divide the ranks --tp "
                        "leaves, --seq-len and the heads of a tensor rank (default 1)")
    g.add_argument("--capture-graphs", nargs="?", const="true", default="auto", choices=("auto", "true", "false"),
                   help="MoE models: replay each MoE layer's routed experts from device graphs captured once per "
                        "shape (less host time per step where tokens are few; docs/autoep.md). auto (the default): "
                        "where they pay, eagerly elsewhere; true (the flag alone): always, refused unless --ep 1, "
                        "--stage 1 or 2 and an accelerator with device graphs; false: never")
    g.add_argument("--offload", action="store_true",
                   help="offload optimizer state to host memory (and parameters too with --stage 3)")
    g.add_argument("--offload-ratio", type=float, default=d.offload_ratio, metavar="R",
                   help="with --offload at --stage 1 or 2: the share of the optimizer (master, moments, step) kept on "
                        "the host; the rest, the layers whose gradients arrive last in backward, stays on the device "
                        "(faster steps for more device memory; default 1: all on the host)")


def _optimizer_arguments(g, d, dtypes, optimizers, kernel_choices, default_lr) -> None:
    """Precision, kernels, the optimizer and its settings."""
    g.add_argument("--dtype", choices=dtypes, default=d.dtype, help=f"training precision (default {d.dtype})")
    g.add_argument("--kernels", nargs="?", const="auto", default=None, choices=kernel_choices,
                   help="the plugins' model kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) in place of "
                        "Hugging Face's modules: auto (the flag alone) each kernel a plugin serves on the device, "
                        "all, or off (default: auto on a device accelerator such as a GPU, off on the cpu plugin; "
                        "docs/model-kernels.md)")
    g.add_argument("--optimizer", choices=optimizers, default=d.optimizer,
                   help="adamw: AdamW for every parameter; muon: Muon (momentum, then Newton-Schulz "
                        "orthogonalization of each hidden matrix, whole, once per step, under every ZeRO stage, "
                        "offload and --tp) with AdamW for the embeddings, head, norms and biases "
                        f"(default {d.optimizer})")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate: AdamW's, or with --optimizer muon the hidden matrices' "
                        f"(default {default_lr['adamw']} for adamw, {default_lr['muon']} for muon)")
    g.add_argument("--adam-lr", type=float, default=None,
                   help=f"--optimizer muon: AdamW's lr for the parameters Muon leaves to it (default {d.adam_lr})")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"default {d.weight_decay}")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help=f"gradient clipping norm, 0 for none (default {d.grad_clip})")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help=f"micro-steps per optimizer step (default {d.grad_accum})")


def _checkpoint_arguments(g) -> None:
    g.add_argument("--save", default=None, metavar="DIR", help="save a checkpoint in DIR at the end of the run")
    g.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps (needs --save)")
    g.add_argument("--resume", default=None, metavar="DIR", help="continue from the latest checkpoint in DIR")
    g.add_argument("--resume-tag", default=None, metavar="TAG",
                   help="resume from this checkpoint tag (e.g. step30) instead of the latest")
    g.add_argument("--init-from", default=None, metavar="FILE",
                   help="start from this Hugging Face safetensors state dict (a file, or a directory with "
                        "model.safetensors) instead of fresh weights; every layout cuts its pieces out of it")


def _error(message: str) -> int:
    print(f"polyaccel train: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import polyaccel
    from polyaccel.errors import PolyaccelError
    from polyaccel.safe_files import write_json

    from .launcher import RankFailed, launch
    from .options import options_from_args
    from .summary import print_summary

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.accelerator:
            polyaccel.set_accelerator(args.accelerator)
        acc = polyaccel.get_accelerator()
        opts = options_from_args(args, acc)
    except PolyaccelError as exc:
        return _error(str(exc))

    from rich.console import Console

    console = Console()
    what = f"resuming {opts.resume}:{opts.resume_tag} at step {opts.start_step}, " if opts.resume else ""
    if opts.init_from:
        what += f"from {opts.init_from}, "
    console.print(
        f"polyaccel train: {opts.nproc} rank(s) on plugin [bold]{acc.name}[/], {what}"
        f"{opts.model.name}, ZeRO stage {opts.stage}{' + offload' if opts.offload else ''}"
        f"{f', tensor parallel {opts.tp} x data {opts.data_parallel}' if opts.tp > 1 else ''}"
        f"{f', expert parallel {opts.ep}' if opts.ep > 1 else ''}"
        f"{f', sequence parallel {opts.sp} x data {opts.data_parallel}' if opts.sp > 1 else ''}, {opts.dtype}, "
        f"{opts.steps} steps", highlight=False,
    )
    from .run_records import claim_save_dir

    try:
        claim = claim_save_dir(opts.save)  # one run at a time writes a --save directory
    except PolyaccelError as exc:
        return _error(str(exc))
    try:
        with claim:
            result = launch(opts)
    except RankFailed as exc:
        if exc.traceback and not exc.expected:
            print(exc.traceback.rstrip(), file=sys.stderr)
        return _error(str(exc))
    except KeyboardInterrupt:
        return _error("interrupted")
    if opts.metrics_out:
        write_json(opts.metrics_out, result)
    print_summary(result, console)
    return 0
