"""Probe a vendor's torch extension (``torch_npu``, ``torch_supa``, ...) and say in words why it is not usable.

A vendor plugin's device lives in an out-of-tree extension that installs ``torch.<device>``
when imported. Detection asks that runtime, never the mere presence of the package: an
installed extension whose native libraries are missing fails at import (``ImportError:
libhccl.so: cannot open shared object file``); that is "unavailable" with the reason, not a
crash and not a wrong selection. The plugins describe their extension with a
:class:`VendorExtension` and base their accelerator on :class:`ExtensionAccelerator`, which
probes through it; nothing here runs at ``import polyaccel``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .accelerator import Accelerator, ProbeResult
from .hookspecs import EMULATED_MARKER


@dataclass(frozen=True)
class VendorExtension:
    """One vendor extension and the words for its failures.

    ``module`` is imported and installs ``torch.<torch_attr>``; ``install_hint`` says how to get
    it, ``libraries`` what an ImportError of an installed one means, ``hint`` (if any) is added
    to every import failure and to the probe's details; ``device`` names one device in the
    probe's reason and ``visible_devices_env`` the variable that hides devices.
    """

    module: str
    torch_attr: str
    install_hint: str
    libraries: str
    device: str
    visible_devices_env: str
    hint: str = ""

    def device_module(self) -> Any | None:
        """``torch.<torch_attr>`` (present only once the extension has been imported)."""
        return getattr(torch, self.torch_attr, None)

    def load(self) -> tuple[Any | None, str]:
        """(the extension's module, "") or (None, why it cannot be used)."""
        name = self.module
        tail = f"; {self.hint}" if self.hint else ""
        mod = sys.modules.get(name)
        if mod is None:
            with contextlib.suppress(ImportError, ValueError):  # found but broken: the import below says how
                if importlib.util.find_spec(name) is None:
                    return None, f"{name} is not installed ({self.install_hint})"
            try:
                mod = importlib.import_module(name)
            except ImportError as exc:
                return None, f"{name} is installed but cannot be imported ({exc}); {self.libraries}{tail}"
            except Exception as exc:  # noqa: BLE001 - any import-time failure is a reason, not a crash
                return None, f"importing {name} failed with {type(exc).__name__}: {exc}{tail}"
        if self.device_module() is None:
            return None, f"{name} imported but torch.{self.torch_attr} is missing ({name} does not match this torch?)"
        return mod, ""

    def is_not_installed(self, reason: str) -> bool:
        """Whether ``reason`` (from :meth:`load`) says the extension is simply absent: nothing to report then."""
        return reason.startswith(f"{self.module} is not installed")

    def facts(self, mod: Any) -> dict[str, Any]:
        """The report facts of a loaded extension: its version and whether it is an emulated stand-in."""
        return {self.module: getattr(mod, "__version__", "unknown"),
                "emulated": getattr(mod, EMULATED_MARKER, False) is True}

    def probe(self) -> ProbeResult:
        """Whether the extension imports and its ``torch.<torch_attr>`` sees a device, with its version."""
        mod, reason = self.load()
        if mod is None:
            return ProbeResult(False, reason, details={"hint": self.hint} if self.hint else {})
        device_module = self.device_module()
        where = f"torch.{self.torch_attr}"
        details = {self.module: getattr(mod, "__version__", "unknown")}
        try:
            available = bool(device_module.is_available())
            count = int(device_module.device_count()) if available else 0
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot answer is unavailable
            return ProbeResult(False, f"{where}.is_available() raised {type(exc).__name__}: {exc}", details=details)
        if not available or count == 0:
            return ProbeResult(False, f"{self.module} imports but {where}.is_available() is False: no {self.device} "
                               f"is visible (check the driver and {self.visible_devices_env})", details=details)
        return ProbeResult(True, "", count, details=details)

    def device_capabilities(self, claims: Iterable[str], graph_class: str) -> set[str]:
        """``claims``, with "graphs" where ``torch.<torch_attr>`` has ``graph_class`` and ``graph``; none without it."""
        device_module = self.device_module()
        if device_module is None:
            return set()
        found = set(claims)
        if hasattr(device_module, graph_class) and hasattr(device_module, "graph"):
            found.add("graphs")
        return found

    def runtime_binding(self, factory: str, functions: tuple[str, ...], *, unavailable: str,
                        failed: str) -> tuple[Any | None, str]:
        """(``torch.<torch_attr>.<factory>()``, "") or (None, why): the runtime-API object with ``functions``.

        ``unavailable`` is the reason when the factory is missing, ``failed`` the words before the
        RuntimeError the factory raised.
        """
        device_module = self.device_module()
        if device_module is None or not hasattr(device_module, factory):
            return None, unavailable
        try:
            binding = getattr(device_module, factory)()
        except RuntimeError as exc:
            return None, f"{failed}: {exc}"
        missing = [n for n in functions if not hasattr(binding, n)]
        if missing:
            return None, f"torch.{self.torch_attr}.{factory}() lacks {', '.join(missing)}"
        return binding, ""


class ExtensionAccelerator(Accelerator):
    """An accelerator whose device comes in a vendor's torch extension, :attr:`vendor`.

    Its visible-devices variable, its probe and its device claims come from the extension:
    :attr:`device_claims` (what ``torch.<device>`` provides wherever the extension imports),
    "graphs" where the device module has :attr:`graph_class`, and "host_register" where
    :meth:`host_register_offered` says so.
    """

    vendor: ClassVar[VendorExtension]
    device_claims: ClassVar[tuple[str, ...]] = ()

    def visible_devices_envs(self) -> list[str]:
        return [self.vendor.visible_devices_env]

    def probe(self) -> ProbeResult:
        return self.vendor.probe()

    def capabilities(self) -> frozenset[str]:
        caps = self.vendor.device_capabilities(self.device_claims, self.graph_class)
        if caps and self.host_register_offered():
            caps.add("host_register")
        return frozenset(caps)

    def host_register_offered(self) -> bool:
        """Whether the loaded extension offers host-memory registration (none by default)."""
        return False
