"""Print AutoTP's tensor-parallel plan for a model: module -> style -> per-rank shard sizes.

MODEL is a family name (llama, llama-tied, mistral, qwen3, phi3, gpt2: the family's default
transformers config, i.e. the released model's shapes) or a directory holding a config.json.
The model is built on the meta device: no weights are read or allocated, nothing is downloaded.
Plan inference and its checks run as in training, so a --tp the heads cannot take, an unknown
plan style or a rule that matches nothing fails here with the same message.

Shard sizes are along the split dimension: output features for column layers, input features
for row layers, vocabulary rows for vocab layers; fused weights show each sub-weight (q+k+v,
gate+up). Layers that differ only in their number are folded into one line (--full lists each).
"""

from __future__ import annotations

import json
import sys

HELP = "print the AutoTP plan (module -> style -> per-rank shard sizes) for a model"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, metavar="NAME",
                        help="family name (llama, llama-tied, mistral, qwen3, phi3, gpt2) or a directory with "
                             "config.json")
    parser.add_argument("--tp", type=int, default=2, metavar="N", help="tensor-parallel degree (default 2)")
    parser.add_argument("--tiny", action="store_true", help="the small test-sized config of the family instead")
    parser.add_argument("--config", default=None, metavar="JSON",
                        help="extra tensor_parallel keys as JSON, e.g. '{\"preset_model\": \"phi3\"}'")
    parser.add_argument("--full", action="store_true", help="one line per module (no folding of layers)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _model(args):
    from polyaccel.cli.meta_model import meta_model

    from .models import FAMILIES, build, full_config, tiny_config

    return meta_model(args.model, FAMILIES, build, full_config, tiny_config, tiny=args.tiny)


def run(args) -> int:
    from polyaccel.errors import PolyaccelError

    from .plan import infer_plan

    try:
        section = json.loads(args.config) if args.config else {}
        if not isinstance(section, dict):
            raise PolyaccelError("--config must be a JSON object")
        section = {**section, "autotp_size": args.tp}
        plan = infer_plan(_model(args), args.tp, section)
    except (PolyaccelError, OSError, ValueError) as exc:
        print(f"polyaccel autotp-plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.format(compact=not args.full))
    return 0
