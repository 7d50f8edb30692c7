"""``polyaccel train --kernels``: the model kernels (RMSNorm, RoPE, SwiGLU, the fused linear cross-entropy;
docs/model-kernels.md) swapped into the model the run trains.

``--kernels`` (or ``--kernels auto``): each kernel whose op a plugin serves on the accelerator's device type;
``--kernels all``: all four; ``--kernels off``: Hugging Face's modules.

Default: ``auto`` when the accelerator is a device (a GPU, an NPU...), ``off`` on the cpu plugin. On a device
the plugins' kernels are what the issue was filed for (the model's own kernels dominate a step there) and they
equal Hugging Face's modules within the ops' tolerance (tests/engines/kernels); on the cpu plugin the builders
are torch code with little to gain, and CPU runs are where numbers are compared against earlier runs.
"""

from __future__ import annotations

from polyaccel.config_check import OneOf, check_flag

CHOICES = ("auto", "all", "off")


def resolve(value: str | None, accelerator) -> str:
    """``--kernels`` as given, or the default for ``accelerator``."""
    if value is None:
        return "off" if accelerator.device_type == "cpu" else "auto"
    return check_flag("--kernels", value, OneOf(CHOICES))


def section(value: str):
    """The engine config's ``kernels`` section for a resolved ``--kernels`` (None: no section)."""
    return {"auto": "auto", "all": True}.get(value)


def summary(engine) -> dict | None:
    """What the kernels layer swapped (per kernel: on, modules swapped) and how many modules it left alone."""
    from polyaccel.parallel import get_plan

    plan = get_plan(engine.module, "kernels")
    if plan is None:
        return None
    return {"kernels": {k: {"on": on, "swapped": plan.count(k)} for k, on in plan.kernels.items()},
            "left_alone": dict(plan.left)}


__all__ = ["CHOICES", "resolve", "section", "summary"]
