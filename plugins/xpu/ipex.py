"""intel-extension-for-pytorch (IPEX): optional, and only when it matches the running torch.

Every IPEX release refuses any torch but its own major.minor, and does so at import time
by printing an error and calling ``os.exit(127)`` (a function that does not exist, so the
import dies with ``AttributeError``; a fixed release could just as well call ``sys.exit``).
So the version is read from the distribution metadata *without importing*; a mismatched
IPEX is never imported. When the version is unknown or matches, the import runs under a
guard that turns any exit call into an ordinary error: importing IPEX never ends the
process.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.metadata as md
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DIST = "intel-extension-for-pytorch"
MODULE = "intel_extension_for_pytorch"

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)")
_guard_lock = threading.Lock()


@dataclass(frozen=True)
class IpexStatus:
    """What polyaccel decided about IPEX, in words for ``polyaccel report``."""

    installed: bool
    version: str | None
    used: bool
    reason: str
    imported: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"installed": self.installed, "version": self.version, "used": self.used, "reason": self.reason}

    def report_facts(self) -> dict[str, Any]:
        """Flat facts for ``polyaccel report``: what was decided about IPEX and why."""
        return {"ipex": self.reason, "ipex_version": self.version, "ipex_used": self.used}


class ExitAttempt(BaseException):
    """Raised instead of exiting when an imported module tries to end the process."""

    def __init__(self, how: str, code: Any):
        super().__init__(f"{how}({code!r})")
        self.how = how
        self.code = code


def major_minor(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    m = _VERSION_RE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_version() -> tuple[bool, str | None]:
    """(installed, version) without importing IPEX: distribution metadata, else its ``_version.py``."""
    try:
        return True, md.version(DIST)
    except md.PackageNotFoundError:
        pass
    loaded = sys.modules.get(MODULE)
    if loaded is not None:
        return True, getattr(loaded, "__version__", None)
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, None
    for folder in spec.submodule_search_locations or ():
        vfile = Path(folder) / "_version.py"
        if vfile.is_file():
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", vfile.read_text(errors="replace"))
            if m:
                return True, m.group(1)
    return True, None


@contextlib.contextmanager
def exit_guard():
    """While active, ``sys.exit``, ``os._exit``, ``exit()`` and a (nonexistent) ``os.exit`` raise
    :class:`ExitAttempt` instead of ending the process. Process-wide, so held under a lock."""

    def raiser(how):
        def _exit(code=None):
            raise ExitAttempt(how, code)

        return _exit

    with _guard_lock:
        saved = [(sys, "exit", sys.exit), (os, "_exit", os._exit), (builtins, "exit", getattr(builtins, "exit", None))]
        had_os_exit = hasattr(os, "exit")
        old_os_exit = getattr(os, "exit", None)
        sys.exit = raiser("sys.exit")
        os._exit = raiser("os._exit")
        builtins.exit = raiser("exit")
        os.exit = raiser("os.exit")
        try:
            yield
        finally:
            for obj, name, value in saved:
                if value is None:
                    with contextlib.suppress(AttributeError):
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)
            if had_os_exit:
                os.exit = old_os_exit
            else:
                with contextlib.suppress(AttributeError):
                    del os.exit


def _forget_partial_import() -> None:
    for key in [k for k in sys.modules if k == MODULE or k.startswith(MODULE + ".")]:
        sys.modules.pop(key, None)


def _mismatch_reason(version: str, torch_version: str) -> str:
    want = major_minor(version)
    return (
        f"ignored: {DIST} {version} works only with torch {want[0]}.{want[1]}.*, but torch {torch_version} "
        f"is running (it would refuse to import); native torch.xpu is used instead. Install the IPEX "
        f"release matching torch, or uninstall it"
    )


def inspect_ipex(torch_version: str | None = None) -> IpexStatus:
    """The cheap verdict, never importing: not installed / mismatched / worth importing."""
    torch_version = torch_version or torch.__version__
    installed, version = installed_version()
    if not installed:
        return IpexStatus(False, None, False, "not installed (optional; native torch.xpu is used)")
    want, have = major_minor(version), major_minor(torch_version)
    if want is not None and want != have:
        return IpexStatus(True, version, False, _mismatch_reason(version, torch_version))
    return IpexStatus(True, version, False, "matches torch; not imported yet")


def load_ipex(torch_version: str | None = None) -> IpexStatus:
    """Import IPEX when it is installed and matches torch; never let the import end the process."""
    torch_version = torch_version or torch.__version__
    verdict = inspect_ipex(torch_version)
    if not verdict.installed or verdict.reason.startswith("ignored"):
        return verdict
    version = verdict.version
    try:
        with exit_guard():
            module = importlib.import_module(MODULE)
    except ExitAttempt as exc:
        _forget_partial_import()
        return IpexStatus(True, version, False,
                          f"ignored: importing {MODULE} tried to end the process ({exc}); its version check "
                          f"rejects torch {torch_version}", imported=True)
    except Exception as exc:  # noqa: BLE001 - any import failure only means "not used"
        _forget_partial_import()
        return IpexStatus(True, version, False, f"ignored: import failed: {type(exc).__name__}: {exc}",
                          imported=True)
    version = getattr(module, "__version__", None) or version
    want, have = major_minor(version), major_minor(torch_version)
    if want is not None and want != have:
        return IpexStatus(True, version, False, _mismatch_reason(version, torch_version), imported=True)
    return IpexStatus(True, version, True, f"used: {DIST} {version} matches torch {torch_version}", imported=True)
