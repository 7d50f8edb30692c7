"""The shared shape of an engine's plan command (``autotp-plan``, ``autoep-plan``): a model family or a
config.json built on the meta device, the engine's parallel degree and extra config keys as JSON, the
plan printed, and every refusal printed as one line naming the command (exit status 1; 2 when --model names
nothing a model can be built from: an unknown family, a config.json transformers rejects).

The engine's command module keeps its docstring, ``HELP`` and any options of its own, and passes
what differs: its names, how to build its model families and how to infer and show its plan.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PlanCommand:
    """What one engine's plan command calls things."""

    name: str  # the command, for error lines: "autotp-plan"
    families: str  # the model families --model takes, for its help: "llama, mistral"
    degree: str  # the degree option without dashes: "tp"
    degree_help: str  # "tensor-parallel degree"
    degree_default: int
    size_key: str  # the config key the degree sets: "autotp_size"
    section: str  # the config section --config adds to: "tensor_parallel"
    config_example: str  # an example for --config's help: '{"preset_model": "phi3"}'
    #: the engine's model-families module (``FAMILIES``, ``build``, ``full_config``, ``tiny_config``),
    #: imported only when the command runs: "polyaccel.engines.autotp.models"
    models: str

    def add_arguments(self, parser) -> None:
        """--model, the degree, --tiny and --config (an engine adds its own options after these)."""
        parser.add_argument("--model", required=True, metavar="NAME",
                            help=f"family name ({self.families}) or a directory with config.json")
        parser.add_argument(f"--{self.degree}", type=int, default=self.degree_default, metavar="N",
                            help=f"{self.degree_help} (default {self.degree_default})")
        parser.add_argument("--tiny", action="store_true",
                            help="the small test-sized config of the family instead")
        parser.add_argument("--config", default=None, metavar="JSON",
                            help=f"extra {self.section} keys as JSON, e.g. '{self.config_example}'")

    def run(self, args, make_plan: Callable[[dict, Callable[[], object]], object],
            show: Callable[[object], str] = str) -> int:
        """Print ``show(make_plan(section, build_model))``; 0, or 1 with the refusal on stderr (2 for a
        --model that builds nothing).

        ``make_plan`` gets the config section (--config with the degree set) and a function that
        builds the meta model (so the engine decides what is checked before the model is built).
        """
        from polyaccel.cli.meta_model import ModelArgumentError
        from polyaccel.errors import PolyaccelError

        try:
            section = json.loads(args.config) if args.config else {}
            if not isinstance(section, dict):
                raise PolyaccelError("--config must be a JSON object")
            section = {**section, self.size_key: getattr(args, self.degree)}
            plan = make_plan(section, lambda: _meta_model(args, self.models))
        except ModelArgumentError as exc:
            print(f"polyaccel {self.name}: {exc}", file=sys.stderr)
            return 2
        except (PolyaccelError, OSError, ValueError) as exc:
            print(f"polyaccel {self.name}: {exc}", file=sys.stderr)
            return 1
        print(show(plan))
        return 0


def _meta_model(args, models_module: str):
    import importlib

    from polyaccel.cli.meta_model import meta_model

    models = importlib.import_module(models_module)
    return meta_model(args.model, models.FAMILIES, models.build, models.full_config, models.tiny_config,
                      tiny=args.tiny)


__all__ = ["PlanCommand"]
