"""Installing a stand-in runtime: fake modules, attributes, environment and imports, all undone on exit."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from .marker import mark_emulated

_MISSING = object()


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the package (it is "installed") but fails while executing it, like a missing .so."""

    def __init__(self, name: str, error: BaseException):
        self.name = name
        self.error = error

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


class _LazyModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, on_import: Callable[[types.ModuleType], None]):
        self.name = name
        self.on_import = on_import

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=False)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        mark_emulated(module)
        self.on_import(module)


class Patcher:
    """Installs fake modules/attributes/env vars and undoes every change, in reverse, on exit.

    On enter and on exit it resets polyaccel's selection (so discovery and probing happen
    afresh against the installed runtime) and clears torch's device-module cache.
    """

    def __init__(self, reset_selection: bool = True):
        self._undo: list[Callable[[], None]] = []
        self._reset_selection = reset_selection

    # -- modules
    def set_module(self, name: str, module: Any) -> Any:
        old = sys.modules.get(name, _MISSING)
        sys.modules[name] = module
        self._undo.append(lambda: self._restore_module(name, old))
        return module

    def remove_module(self, name: str) -> None:
        """Hide an imported module (and its submodules) until exit."""
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            old = sys.modules.pop(key)
            self._undo.append(lambda key=key, old=old: sys.modules.__setitem__(key, old))

    def fail_import(self, name: str, error: BaseException) -> None:
        """Make ``import name`` raise ``error`` (e.g. a vendor library missing) until exit."""
        self.remove_module(name)
        finder = _FailingImport(name, error)
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder))

    def lazy_module(self, name: str, on_import: Callable[[types.ModuleType], None]) -> None:
        """Make ``name`` importable; ``on_import(module)`` runs when (and only when) it is imported.

        For extensions whose import has side effects (registering kernels, patching torch):
        the effect appears at import time, as with the real package.
        """
        self.remove_module(name)
        finder = _LazyModule(name, on_import)
        sys.meta_path.insert(0, finder)

        def undo() -> None:
            sys.meta_path.remove(finder)
            for key in [k for k in sys.modules if k == name]:
                del sys.modules[key]

        self._undo.append(undo)

    @staticmethod
    def _restore_module(name: str, old: Any) -> None:
        if old is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old

    # -- attributes
    def setattr(self, obj: Any, name: str, value: Any) -> Any:
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
        setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(undo)
        return value

    def delattr(self, obj: Any, name: str) -> None:
        if name not in getattr(obj, "__dict__", {}):
            return
        old = obj.__dict__[name]
        delattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))

    # -- environment
    def setenv(self, name: str, value: str | None) -> None:
        old = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # -- lifecycle
    def refresh(self) -> None:
        torch.get_device_module.cache_clear()
        if self._reset_selection:
            from ... import selection

            selection.reset()

    def restore(self) -> None:
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep undoing the rest; report afterwards
                errors.append(exc)
        self.refresh()
        if errors:
            raise RuntimeError(f"emulation teardown failed: {errors!r}")

    def __enter__(self) -> Patcher:
        self.refresh()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
