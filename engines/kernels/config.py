"""The ``kernels`` config section, validated.

Three forms::

    "kernels": {"rms_norm": true, "rope": true, "swiglu": true, "cross_entropy": true}
    "kernels": "auto"      # each kernel whose op has a plugin builder on the device type trained on
    "kernels": true        # all four; false: none

In the dict form a kernel left out is off, and a kernel's value may be ``true``, ``false`` or ``"auto"``.
What ``"auto"`` turns on is decided per kernel by :func:`resolve_auto` (a kernel is on when a plugin, not
only the core's plain-torch reference, serves its op on that device type): the reference is the
definition of the math, not a faster path, so swapping it in would trade Hugging Face's code for
another unfused one.

:func:`parse` never modifies the caller's value; every error names the key and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyaccel.config_check import OneOf, Section
from polyaccel.errors import ConfigError

SECTION = "kernels"
#: kernel -> the op (in ``polyaccel.ops``) it runs
KERNELS = {
    "rms_norm": "rms_norm", "rope": "rope", "swiglu": "swiglu", "cross_entropy": "linear_cross_entropy",
}
AUTO = "auto"
#: a kernel's value in the dict form
_CHOICE = OneOf((True, False, AUTO))


@dataclass(frozen=True)
class KernelsConfig:
    """Per kernel: True, False or ``"auto"`` (decided on the device type by :func:`resolve_auto`)."""

    rms_norm: bool | str = False
    rope: bool | str = False
    swiglu: bool | str = False
    cross_entropy: bool | str = False

    def wanted(self) -> dict[str, bool | str]:
        return {name: getattr(self, name) for name in KERNELS}


def expand(value) -> dict:
    """The dict form of a ``kernels`` section (a new dict): ``"auto"`` / ``true`` / ``false`` expanded."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str) and value == AUTO:
        return dict.fromkeys(KERNELS, AUTO)
    if isinstance(value, bool):
        return dict.fromkeys(KERNELS, value)
    raise ConfigError(f"config key {SECTION!r} must be a dict of kernels ({', '.join(KERNELS)}: true, false "
                      f"or 'auto'), the string 'auto', true or false; got {value!r}")


def parse(value) -> KernelsConfig:
    """Validate a ``kernels`` section (any of the three forms)."""
    section = Section(expand(value), SECTION, KERNELS)
    return KernelsConfig(**section.values(dict.fromkeys(KERNELS, _CHOICE)))


def resolve_auto(cfg: KernelsConfig, device_type: str, registry) -> tuple[dict[str, bool], dict[str, str]]:
    """(kernel -> on, kernel -> why) for ``device_type``; an explicit true/false stays as written."""
    on: dict[str, bool] = {}
    why: dict[str, str] = {}
    for name, want in cfg.wanted().items():
        if want is not AUTO and want != AUTO:
            on[name] = bool(want)
            why[name] = "asked for" if want else "not asked for"
            continue
        op = KERNELS[name]
        try:
            builder = registry.chosen(op, device_type)
        except Exception as exc:  # noqa: BLE001 - no builder at all: auto leaves the kernel off, saying why
            on[name], why[name] = False, f"auto: no builder of {op!r} runs on {device_type!r} ({exc})"
            continue
        fused = builder.kind != "reference"
        on[name] = fused
        why[name] = (f"auto: {op!r} runs {builder.name} ({builder.plugin}) on {device_type!r}" if fused else
                     f"auto: only the core's reference serves {op!r} on {device_type!r}")
    return on, why


__all__ = ["AUTO", "KERNELS", "SECTION", "KernelsConfig", "expand", "parse", "resolve_auto"]
