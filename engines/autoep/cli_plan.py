"""Print AutoEP's expert-parallel plan for a model: layer -> experts per rank -> routing.

MODEL is a family name (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe: the
family's default transformers config, i.e. the released model's shapes) or a directory
holding a config.json. The model is built on the meta device: no weights are read or
allocated, nothing is downloaded. Detection and every check run as in training, so an
``--ep`` that does not divide the experts, or a layout AutoEP does not know, fails here
with the same message.
"""

from __future__ import annotations

import json
import sys

HELP = "print the AutoEP plan (MoE layers, experts per EP rank, routing) for a model"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, metavar="NAME",
                        help="family name (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe) "
                             "or a directory with config.json")
    parser.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel degree (default 1)")
    parser.add_argument("--tiny", action="store_true", help="the small test-sized config of the family instead")
    parser.add_argument("--config", default=None, metavar="JSON",
                        help="extra expert_parallel keys as JSON, e.g. '{\"top_k\": 4}'")


def _model(args):
    from polyaccel.cli.meta_model import meta_model

    from .models import FAMILIES, build, full_config, tiny_config

    return meta_model(args.model, FAMILIES, build, full_config, tiny_config, tiny=args.tiny)


def run(args) -> int:
    from polyaccel.errors import PolyaccelError

    from .config import parse_config
    from .detect import detect

    try:
        section = json.loads(args.config) if args.config else {}
        if not isinstance(section, dict):
            raise PolyaccelError("--config must be a JSON object")
        section = {**section, "autoep_size": args.ep}
        cfg = parse_config(section)
        plan = detect(_model(args), cfg)
    except (PolyaccelError, OSError, ValueError) as exc:
        print(f"polyaccel autoep-plan: {exc}", file=sys.stderr)
        return 1
    print(plan)
    return 0
