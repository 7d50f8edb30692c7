"""One way to check a config section: typed rules, the key path in every error, the caller's dict only read.

Every layer's config (ZeRO, Muon, AutoTP, AutoEP, AutoSP, the model kernels) and ``polyaccel train``'s
flags are checked with these rules, so a value means the same thing wherever it is written:

- **integer** (:class:`Int`): an ``int``, or a float with no fractional part (``2.0``, JSON's ``5e8``) taken
  as that int, as DeepSpeed's pydantic config does; ``2.5``, ``True``/``False``, NaN, inf and strings are
  refused.
- **number** (:class:`Float`): an int or a float, finite (NaN and inf are refused), never a bool.
- **flag** (:class:`Bool`): ``True`` or ``False`` only (not 0/1, not "yes").
- **choice** (:class:`OneOf`): one of the listed values; strings match in any case and come back as
  listed, integer choices follow the integer rule.
- ``optional=True``: ``None`` (JSON null) is accepted and means "the default".

A :class:`Section` is the read-only view of one dict of the config: unknown keys are refused with the
keys allowed there and a did-you-mean, and every error is a :class:`ConfigError` naming the full key
path (``config key 'zero_optimization.offload_optimizer.pin_memory' must be true or false, got 'no'``).
:func:`check_flag` words the same rules for a command-line flag (``--steps 0: must be at least 1``).

A small module rather than pydantic (DeepSpeed's choice): no runtime dependency for the core, and every
error worded like the rest of polyaccel's, with the key path and the fix.
"""

from __future__ import annotations

import abc
import difflib
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "Bool", "Float", "Floats", "Int", "OneOf", "Regex", "Rule", "Section", "Strings", "Text", "check",
    "check_flag", "config_error", "integer_value", "key_path", "number_value",
]

_BAD = object()  # what a rule's ``_parse`` returns for a value it refuses


def key_path(parent: str, key: Any) -> str:
    """``parent`` joined with ``key``: ``'a.b'``, ``'a[0]'`` for a list index, ``'b'`` at the top level."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def config_error(path: str, text: str) -> ConfigError:
    """``config key '<path>' <text>``: the error of every check (``text``: what is wrong and the fix)."""
    return ConfigError(f"config key {path!r} {text}" if path else f"the config {text}")


def _show(value: Any) -> str:
    """A value as the config (JSON) writes it, in short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer_value(value: Any) -> int | None:
    """The integer rule: ``value`` as an int (``2`` and ``2.0`` give 2), or None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def number_value(value: Any) -> float | None:
    """The number rule: ``value`` as a finite float, or None (bools, NaN, inf and non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Rule(abc.ABC):
    """What one value may be. ``check`` returns the parsed value or raises a :class:`ConfigError`; each rule
    says what it wants (``_what``) and parses a value (``_parse``: the value, or ``_BAD``)."""

    optional: bool = field(default=False, kw_only=True)

    def check(self, value: Any, path: str, hint: str = "") -> Any:
        if value is None and self.optional:
            return None
        parsed = self._parse(value)
        if parsed is _BAD:
            got = type(value).__name__ if isinstance(value, Mapping) else _show(value)
            raise config_error(path, f"must be {self.describe()}, got {got}{'; ' + hint if hint else ''}")
        return parsed

    def describe(self) -> str:
        return self._what() + (" or null" if self.optional else "")

    def flag_text(self, value: Any = None) -> str:
        """The rule worded for a command-line flag, whose type the argument parser has usually fixed."""
        return f"must be {self._what()}"

    @abc.abstractmethod
    def _what(self) -> str: ...

    @abc.abstractmethod
    def _parse(self, value: Any) -> Any: ...


def _number(x) -> str:
    """A bound as written in a rule: ``0`` rather than ``0.0``."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _bound(lo, hi, lo_open: bool, hi_open: bool) -> str:
    """``>= 1``, ``> 0``, ``<= 3`` or ``in [0, 1)``."""
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_number(lo)}, {_number(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_number(lo)}"
    return f"{'<' if hi_open else '<='} {_number(hi)}" if hi is not None else ""


def _within(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    above = lo is None or (v > lo if lo_open else v >= lo)
    return above and (hi is None or (v < hi if hi_open else v <= hi))


@dataclass(frozen=True)
class Int(Rule):
    """An integer in ``[minimum, maximum]`` (either bound may be left out)."""

    minimum: int | None = None
    maximum: int | None = None

    def _what(self) -> str:
        bound = _bound(self.minimum, self.maximum, False, False)
        return f"an integer {bound}".rstrip()

    def flag_text(self, value: Any = None) -> str:
        if integer_value(value) is None:  # not typed by the argument parser: say what the type is too
            return f"must be {self._what()}"
        if self.maximum is None and self.minimum is not None:
            return f"must be at least {self.minimum}"
        return f"must be {_bound(self.minimum, self.maximum, False, False)}"

    def _parse(self, value: Any) -> Any:
        v = integer_value(value)
        return v if v is not None and _within(v, self.minimum, self.maximum, False, False) else _BAD


@dataclass(frozen=True)
class Float(Rule):
    """A finite number in the range the bounds give; ``above``/``below`` make a bound exclusive."""

    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    below: bool = False

    def _what(self) -> str:
        bound = _bound(self.minimum, self.maximum, self.above, self.below)
        if self.maximum is not None and self.minimum is not None:
            return f"a number {bound}"  # a closed range says finite already
        return f"a finite number {bound}".rstrip()

    def flag_text(self, value: Any = None) -> str:
        if self.minimum == 0 and self.above and self.maximum is None:
            return "must be a positive finite number"
        if self.maximum is None:
            return f"must be {self._what()}"
        return f"must be {_bound(self.minimum, self.maximum, self.above, self.below)}"

    def _parse(self, value: Any) -> Any:
        v = number_value(value)
        return v if v is not None and _within(v, self.minimum, self.maximum, self.above, self.below) else _BAD


@dataclass(frozen=True)
class Bool(Rule):
    def _what(self) -> str:
        return "true or false"

    def describe(self) -> str:
        return "true, false or null" if self.optional else "true or false"

    def _parse(self, value: Any) -> Any:
        return value if isinstance(value, bool) else _BAD


@dataclass(frozen=True)
class OneOf(Rule):
    """One of ``choices``: strings in any case (the listed spelling comes back), ints by the integer rule."""

    choices: tuple = ()

    def check(self, value: Any, path: str, hint: str = "") -> Any:
        if isinstance(value, str):
            names = {c.lower(): c for c in self.choices if isinstance(c, str)}
            guess = difflib.get_close_matches(value.lower(), list(names), n=1, cutoff=0.6)
            if guess and value.lower() != guess[0]:
                hint = "; ".join(h for h in (hint, f"did you mean {names[guess[0]]!r}?") if h)
        return super().check(value, path, hint)

    def _what(self) -> str:
        return f"one of {', '.join(c if isinstance(c, str) else _show(c) for c in self.choices)}"

    def flag_text(self, value: Any = None) -> str:
        return f"choose {self._what()}"

    def _parse(self, value: Any) -> Any:
        for choice in self.choices:
            if isinstance(choice, bool) or choice is None:
                if value is choice:
                    return choice
            elif isinstance(choice, str):
                if isinstance(value, str) and value.lower() == choice.lower():
                    return choice
            elif isinstance(choice, int) and integer_value(value) == choice:
                return choice
        return _BAD


@dataclass(frozen=True)
class Text(Rule):
    """A non-empty string."""

    def _what(self) -> str:
        return "a non-empty string"

    def _parse(self, value: Any) -> Any:
        return value if isinstance(value, str) and value else _BAD


@dataclass(frozen=True)
class Regex(Rule):
    """A regular expression (the string is returned; a pattern that does not compile is refused)."""

    def check(self, value: Any, path: str, hint: str = "") -> Any:
        pattern = Text(optional=self.optional).check(value, path, hint)
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise config_error(path, f"is not a valid regular expression ({exc}): {pattern!r}") from None
        return pattern

    def _what(self) -> str:
        return "a regular expression"

    def _parse(self, value: Any) -> Any:
        try:
            return value if isinstance(value, str) and value and re.compile(value) else _BAD
        except re.error:
            return _BAD


@dataclass(frozen=True)
class Strings(Rule):
    """A list of non-empty strings, as a tuple; one string is taken as a list of one."""

    what: str = "strings"
    nonempty: bool = False

    def _what(self) -> str:
        return f"a {'non-empty ' if self.nonempty else ''}list of {self.what}"

    def _parse(self, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x for x in value):
            return _BAD
        if self.nonempty and not value:
            return _BAD
        return tuple(value)


@dataclass(frozen=True)
class Floats(Rule):
    """Exactly ``count`` numbers, each by ``each`` (a :class:`Float`), as a tuple of floats."""

    count: int = 2
    each: Float = Float()

    def _what(self) -> str:
        words = {2: "two", 3: "three"}
        noun = self.each._what().removeprefix("a ").replace("number", "numbers", 1)
        return f"{words.get(self.count, self.count)} {noun}"

    def _parse(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != self.count:
            return _BAD
        parsed = [self.each._parse(x) for x in value]
        return _BAD if any(p is _BAD for p in parsed) else tuple(parsed)


def check(value: Any, rule: Rule, path: str, hint: str = "") -> Any:
    """``value`` (at ``path``) by ``rule``: the parsed value, or a :class:`ConfigError` naming ``path``."""
    return rule.check(value, path, hint)


def check_flag(flag: str, value: Any, rule: Rule, hint: str = "") -> Any:
    """A command-line flag's value by ``rule``; refused as ``--steps 0: must be at least 1`` or ``--dtype
    'int8': choose one of fp32, bf16, fp16``."""
    if value is None and rule.optional:
        return None
    parsed = rule._parse(value)
    if parsed is _BAD:
        shown = repr(value) if isinstance(value, str) else value
        raise ConfigError(f"{flag} {shown}: {rule.flag_text(value)}{' ' + hint if hint else ''}")
    return parsed


def _unknown_keys_error(path: str, unknown: list[str], allowed: Iterable[str]) -> ConfigError:
    allowed = sorted(allowed)
    names = ", ".join(repr(key_path(path, k)) for k in unknown)
    where = f" in {path!r}" if path else ""
    guesses = [m for k in unknown for m in difflib.get_close_matches(k, allowed, n=1, cutoff=0.6)]
    guess = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
    return ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} {names}; allowed keys{where}: "
                       f"{', '.join(allowed)}{guess}")


class Section:
    """The read-only view of the dict at ``path`` whose keys may only be ``keys``.

    ``None`` is the empty section. The dict is never written to; what the getters return is parsed
    (tuples for lists), so a config object built from them shares nothing mutable with the caller's dict.
    """

    def __init__(self, value: Any, path: str, keys: Iterable[str]):
        self.path = path
        self.keys = tuple(keys)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise config_error(path, f"must be a dict, got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in self.keys)
        if unknown:
            raise _unknown_keys_error(path, unknown, self.keys)
        self._value = value

    def __contains__(self, key: str) -> bool:
        return key in self._value

    def key(self, key: Any) -> str:
        """The full path of ``key`` in this section."""
        return key_path(self.path, key)

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written (for checks across keys); prefer :meth:`get`."""
        return self._value.get(key, default)

    def get(self, key: str, rule: Rule, default: Any = None, hint: str = "") -> Any:
        """The parsed value of ``key``; ``default`` when it is absent or null (where ``rule`` allows null)."""
        if key not in self._value:
            return default
        parsed = rule.check(self._value[key], self.key(key), hint)
        return default if parsed is None else parsed

    def values(self, rules: Mapping[str, Rule]) -> dict[str, Any]:
        """``{key: parsed value}`` of the keys of ``rules`` present and not null, in ``rules``' order."""
        out = {}
        for key, rule in rules.items():
            parsed = self.get(key, rule)
            if parsed is not None:
                out[key] = parsed
        return out

    def section(self, key: str, keys: Iterable[str]) -> Section:
        """The sub-section at ``key`` (absent or null: empty)."""
        return Section(self._value.get(key), self.key(key), keys)

    def items(self, key: str) -> list[tuple[str, Any]]:
        """``[(path, item)]`` of the list at ``key`` (absent or null: empty)."""
        value = self._value.get(key)
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        return [(key_path(self.key(key), i), item) for i, item in enumerate(value)]

    def require(self, key: str, why: str, rule: Rule | None = None) -> Any:
        """The value of a key that must be given (parsed by ``rule`` if one is given); ``why`` says what it is
        for, in the error when it is missing."""
        if key not in self._value:
            raise self.error(key, f"is required: {why}")
        return self._value[key] if rule is None else rule.check(self._value[key], self.key(key))

    def error(self, key: str, text: str) -> ConfigError:
        """A :class:`ConfigError` about ``key`` of this section."""
        return config_error(self.key(key), text)
