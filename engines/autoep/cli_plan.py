"""Print AutoEP's expert-parallel plan for a model: layer -> experts per rank -> routing.

MODEL is a family name (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe: the
family's default transformers config, i.e. the released model's shapes) or a directory
holding a config.json. The model is built on the meta device: no weights are read or
allocated, nothing is downloaded. Detection and every check run as in training, so an
``--ep`` that does not divide the experts, or a layout AutoEP does not know, fails here
with the same message.
"""

from __future__ import annotations

from polyaccel.cli.plan_command import PlanCommand

HELP = "print the AutoEP plan (MoE layers, experts per EP rank, routing) for a model"

COMMAND = PlanCommand("autoep-plan", families="mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe",
                      degree="ep", degree_help="expert-parallel degree", degree_default=1, size_key="autoep_size",
                      section="expert_parallel", config_example='{"top_k": 4}', models=f"{__package__}.models")

add_arguments = COMMAND.add_arguments


def _plan(section: dict, model):
    """Check the section before the model is built, then detect its MoE layers."""
    from .config import parse_config
    from .detect import detect

    cfg = parse_config(section)
    return detect(model(), cfg)


def run(args) -> int:
    return COMMAND.run(args, _plan)
