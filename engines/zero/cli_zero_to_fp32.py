"""Consolidate a ZeRO checkpoint into one full-precision state dict (safetensors).

Reads every rank's shard of CKPT_DIR (the tag named in its ``latest`` file unless --tag is
given) and writes the model's full state dict, trainable parameters from the fp32 master
weights, to OUT (a file, or a directory that receives ``model.safetensors``). Works offline:
no process group, no model code, any world size and ZeRO stage. Shows a progress bar for
big checkpoints. OUT must lie outside CKPT_DIR (the conversion never writes into what it reads). Every
file of the checkpoint is checked against the size and checksum recorded
at save first (--no-verify skips the checksums; `polyaccel checkpoint verify` checks only).
"""

from __future__ import annotations

import sys

HELP = "consolidate a sharded ZeRO checkpoint into a full fp32 state dict (safetensors)"


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="directory given to engine.save_checkpoint")
    parser.add_argument("output", metavar="OUT", help="output .safetensors file (or directory)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the checksums (needed for checkpoints saved before polyaccel recorded them)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show a progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")


def run(args) -> int:
    from polyaccel.errors import PolyaccelError

    from .consolidate import check_output_outside, consolidate, save_state_dict

    try:
        check_output_outside(args.output, args.checkpoint_dir)  # before the (long) read, and again before the write
        state = consolidate(args.checkpoint_dir, tag=args.tag, progress=args.progress, verify=args.verify)
        out = save_state_dict(state, args.output, checkpoint_dir=args.checkpoint_dir)
    except (PolyaccelError, OSError) as exc:
        print(f"polyaccel zero-to-fp32: {exc}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements) to {out}")
    return 0
