"""DeepSpeed on any polyaccel plugin: the selected accelerator as DeepSpeed's, polyaccel's optimizer ops as
builders.

::

    import polyaccel.integrations.deepspeed as pds

    pds.install()                  # before deepspeed.initialize; selects polyaccel's accelerator first
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)

Importing this module neither imports DeepSpeed nor changes it: :func:`install` does both. DeepSpeed binds its
op builders while ``import deepspeed`` runs, so an accelerator set afterwards is too late for them; install()
therefore sets the accelerator and then rebinds every builder name DeepSpeed's loaded modules hold. The names
that subclass DeepSpeed's classes (:class:`PolyaccelDeepSpeedAccelerator`, the builders) live in
``._deepspeed_classes`` and import DeepSpeed at first use. What DeepSpeed gets:
docs/integrations-deepspeed.md.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import polyaccel

from ._deepspeed_base import (
    FALLBACK_LINE,
    MAPPED_BUILDERS,
    CPUAdamOp,
    FusedAdamOp,
    FusedLionOp,
    import_deepspeed_quietly,
)

if TYPE_CHECKING:
    from ._deepspeed_classes import PolyaccelDeepSpeedAccelerator

#: names defined in :mod:`._deepspeed_classes` (they subclass DeepSpeed's): imported with DeepSpeed at first
#: use
_DEEPSPEED_CLASSES = ("CPUAdamBuilder", "FusedAdamBuilder", "FusedLionBuilder", "NotImplementedBuilder",
                      "PolyaccelDeepSpeedAccelerator")


def __getattr__(name: str):
    if name in _DEEPSPEED_CLASSES:
        from . import _deepspeed_classes

        return getattr(_deepspeed_classes, name)
    if name == "deepspeed":
        return import_deepspeed_quietly()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------- install
def _builder_names(op_builder_module) -> list[str]:
    return [name for name in vars(op_builder_module)
            if name.endswith("Builder") and name not in ("OpBuilder", "CUDAOpBuilder")]


def install(accelerator=None) -> PolyaccelDeepSpeedAccelerator:
    """Make DeepSpeed run on polyaccel: set the accelerator and rebind every op builder DeepSpeed bound.

    ``accelerator``: a polyaccel accelerator or plugin name (default: the selected one; a name is selected
    with :func:`polyaccel.set_accelerator`). Returns the DeepSpeed accelerator now in force. Idempotent.
    """
    import_deepspeed_quietly()  # before any ``deepspeed.*`` import, which would import deepspeed loudly
    from deepspeed.accelerator import real_accelerator

    from ._deepspeed_classes import PolyaccelDeepSpeedAccelerator

    if isinstance(accelerator, str):
        accelerator = polyaccel.set_accelerator(accelerator)
    current = real_accelerator.ds_accelerator
    if isinstance(current, PolyaccelDeepSpeedAccelerator) and (accelerator is None
                                                               or current.polyaccel is accelerator):
        return current
    ds_acc = PolyaccelDeepSpeedAccelerator(accelerator)
    real_accelerator.set_accelerator(ds_acc)

    import deepspeed.ops.op_builder as op_builder

    # DeepSpeed binds one class to many names (its NotImplementedBuilder): rebind by name, and by identity
    # only where an old class stood for one name (an alias such as ``import FusedAdamBuilder as FAB``)
    names_of: dict[int, set[str]] = {}
    old_classes: dict[int, object] = {}
    for name in _builder_names(op_builder):
        old = getattr(op_builder, name)
        names_of.setdefault(id(old), set()).add(name)
        old_classes[id(old)] = old
        setattr(op_builder, name, ds_acc.get_op_builder(name))
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "deepspeed" or mod_name.startswith("deepspeed.")):
            continue
        if mod_name.startswith(("deepspeed.ops.op_builder", "deepspeed.accelerator")):
            continue  # where DeepSpeed's builders and accelerators are defined (op_builder itself is done)
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            if current is not None and value is current:
                setattr(mod, attr, ds_acc)
                continue
            names = names_of.get(id(value))
            if names is None or old_classes[id(value)] is not value:
                continue
            if attr in names:
                setattr(mod, attr, ds_acc.get_op_builder(attr))
            elif len(names) == 1:
                setattr(mod, attr, ds_acc.get_op_builder(next(iter(names))))
    return ds_acc


def installed() -> PolyaccelDeepSpeedAccelerator | None:
    """The polyaccel accelerator DeepSpeed uses, or None when :func:`install` was not called (or DeepSpeed was
    never imported: then nothing was installed, and this does not import it)."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.accelerator import real_accelerator

    from ._deepspeed_classes import PolyaccelDeepSpeedAccelerator

    acc = real_accelerator.ds_accelerator
    return acc if isinstance(acc, PolyaccelDeepSpeedAccelerator) else None


__all__ = ["CPUAdamOp", "FALLBACK_LINE", "FusedAdamOp", "FusedLionOp", "MAPPED_BUILDERS",
           "import_deepspeed_quietly", "install", "installed",
           *_DEEPSPEED_CLASSES]
