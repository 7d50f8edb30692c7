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

from polyaccel.cli.plan_command import PlanCommand

HELP = "print the AutoTP plan (module -> style -> per-rank shard sizes) for a model"

COMMAND = PlanCommand("autotp-plan", families="llama, llama-tied, mistral, qwen3, phi3, gpt2", degree="tp",
                      degree_help="tensor-parallel degree", degree_default=2, size_key="autotp_size",
                      section="tensor_parallel", config_example='{"preset_model": "phi3"}',
                      models=f"{__package__}.models")


def add_arguments(parser) -> None:
    COMMAND.add_arguments(parser)
    parser.add_argument("--full", action="store_true", help="one line per module (no folding of layers)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    from .plan import infer_plan

    def show(plan) -> str:
        return json.dumps(plan.to_dict(), indent=1) if args.json else plan.format(compact=not args.full)

    return COMMAND.run(args, lambda section, model: infer_plan(model(), args.tp, section), show)
