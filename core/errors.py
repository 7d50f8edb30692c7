"""Exceptions shared by every layer of polyaccel."""

from __future__ import annotations


class PolyaccelError(RuntimeError):
    """Base class of every error polyaccel raises on purpose."""


class Unsupported(PolyaccelError, NotImplementedError):
    """A backend was asked for something it does not have.

    Raised instead of silently doing nothing: ``plugin`` names the backend and
    ``feature`` the missing piece, so callers (and the conformance suite) can
    tell an honest "no" from a broken implementation.
    """

    def __init__(self, plugin: str, feature: str, hint: str = ""):
        self.plugin = plugin
        self.feature = feature
        self.hint = hint
        msg = f"accelerator plugin {plugin!r} does not support {feature}"
        if hint:
            msg += f": {hint}"
        super().__init__(msg)


class InvalidArgument(PolyaccelError, ValueError):
    """A call got an argument value it cannot take; a ``ValueError`` too, as torch's own checks raise."""


class SelectionError(PolyaccelError):
    """No accelerator could be selected as asked (unknown name, unavailable, tie)."""


class OpError(PolyaccelError):
    """An op could not be resolved or was called with bad arguments."""


class OpArgumentError(OpError, InvalidArgument):
    """An op was called with arguments it cannot take (lengths, shapes, dtypes, devices, modes)."""


class ConfigError(PolyaccelError, ValueError):
    """An invalid configuration value; the message names the key and the allowed values."""


class CheckpointError(PolyaccelError):
    """A checkpoint could not be saved or loaded as it is: a file is missing, damaged or inconsistent.

    ``path`` is the file (or folder) at fault, so callers (the trainers' integrations, the CLI) can
    name it without parsing the message; the message says what is wrong and what to do.
    """

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = str(path) if path is not None else None
