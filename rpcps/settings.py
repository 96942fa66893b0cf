"""One declaration per setting: config dataclass fields that carry their own command-line metadata.

A field declared with ``setting(...)`` is a user-facing setting: its help text, flag (by default
``--`` plus the field name with dashes), environment variable (``RPCPS_`` plus the flag's name),
torchrun alias and choices live on the field itself. The command line (``cli/``) generates its
parsers, ``--help``, environment handling and the launcher's child command lines from these
declarations, so a setting's name, default and choices exist in exactly one place: the config class
that uses it. Fields declared with a plain default are internal (set by code, never by a user).

A field whose type is itself a config dataclass (and that is not a setting) is a group: its
settings are the group's settings, shown under the group's heading in ``--help``.

Precedence everywhere: command-line flag > ``RPCPS_<NAME>`` > torchrun's variable > default.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpcps.address import Address, StoreAddress, parse_store_address

_KEY = "rpcps.setting"
ENV_PREFIX = "RPCPS_"


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str | None = None
    """The command-line flag; None derives ``--field-name`` from the field."""
    choices: Callable[[], Sequence[str]] | None = None
    """Where the allowed values come from (the registry that implements them)."""
    torchrun: str | Callable[[Mapping[str, str]], str | None] | None = None
    """torchrun's environment variable for this setting, or a function of the environment."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """Turns text into a value; None derives it from the field's type."""
    show: Callable[[Any], str] | None = None
    """Turns a value back into text for a child's command line; None derives it from the type."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    **kwargs: Any,
) -> Any:
    """A dataclass field that is also a user-facing setting (see the module docstring)."""
    meta = {_KEY: Setting(help=help, **kwargs)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class BadValue(ValueError):
    """Text that is not a valid value for a setting; the message says what was expected."""


@dataclass(frozen=True)
class Declared:
    """One setting as found in a config tree."""

    path: tuple[str, ...]
    """Field names from the root config down to this field."""
    field: dataclasses.Field
    setting: Setting
    type: Any
    group: str
    """The heading it is shown under (the group's config class), '' at the root."""

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def default(self) -> Any:
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return None

    @property
    def choices(self) -> list[str] | None:
        if self.setting.choices is not None:
            return list(self.setting.choices())
        base = _base_type(self.type)
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return [str(m.value) for m in base]
        if base is bool:
            return ["on", "off"]
        return None

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for; raises BadValue naming what was expected."""
        if self.setting.parse is not None:
            try:
                return self.setting.parse(text)
            except ValueError as e:
                raise BadValue(str(e)) from None
        value = _parse_as(self.type, text)
        choices = self.choices
        if choices is not None and _show(value) not in choices:
            raise BadValue(f"{text!r} is not one of {choices}")
        return value

    def show(self, value: Any) -> str:
        return self.setting.show(value) if self.setting.show is not None else _show(value)

    def torchrun_value(self, environ: Mapping[str, str]) -> str | None:
        alias = self.setting.torchrun
        if alias is None:
            return None
        return alias(environ) if callable(alias) else environ.get(alias)


def declared(config_class: type, exclude: Sequence[str] = ()) -> list[Declared]:
    """Every setting of ``config_class`` and its groups, in declaration order, minus ``exclude``: flags
    (``--listen``), or one field's dotted path (``server.store``: another field keeps its flag)."""
    found = list(_walk(config_class, (), ""))
    return [d for d in found if d.flag not in exclude and ".".join(d.path) not in exclude]


def _walk(cls: type, path: tuple[str, ...], group: str) -> Iterator[Declared]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        meta = f.metadata.get(_KEY)
        if meta is not None:
            yield Declared(path + (f.name,), f, meta, kind, group)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield from _walk(kind, path + (f.name,), _heading(kind) or group)


def _heading(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else cls.__name__


def build(config_class: type, values: Mapping[tuple[str, ...], Any], **fixed: Any) -> Any:
    """Constructs ``config_class`` with ``values`` (by field path); everything else keeps its default.

    ``fixed`` sets top-level fields directly (internal fields, or values a launcher chose).
    Validation is the config classes' own (``__post_init__``).
    """
    return _build(config_class, (), values, fixed)


def _build(cls: type, path: tuple[str, ...], values: Mapping[tuple[str, ...], Any], fixed: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = path + (f.name,)
        if not path and f.name in fixed:
            kwargs[f.name] = fixed[f.name]
        elif here in values:
            kwargs[f.name] = values[here]
        elif _KEY not in f.metadata and dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], here, values, {})
    return cls(**kwargs)


def to_argv(config: Any, settings: Sequence[Declared]) -> list[str]:
    """Flags that reproduce ``config``'s non-default settings (for a launcher's child processes)."""
    argv: list[str] = []
    for d in settings:
        value = config
        for name in d.path:
            value = getattr(value, name)
        if value is not None and value != d.default:
            argv += [d.flag, d.show(value)]
    return argv


# ---- text <-> value by type -------------------------------------------------------------------------


def _base_type(kind: Any) -> Any:
    """``X`` for ``X | None`` (``StoreAddress`` for ``Address | EtcdAddress | None``); the type itself otherwise."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        if set(args) == set(typing.get_args(StoreAddress)):
            return StoreAddress
    return kind


_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def _parse_as(kind: Any, text: str) -> Any:
    base = _base_type(kind)
    origin = typing.get_origin(base)
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise BadValue(f"{text!r} is not on or off")
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise BadValue(f"{text!r} is not an integer") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise BadValue(f"{text!r} is not a number") from None
    if base is Address or base is StoreAddress:
        try:
            return Address.parse(text) if base is Address else parse_store_address(text)
        except ValueError as e:
            raise BadValue(str(e)) from None
    if origin is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if origin is dict or base is dict:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise BadValue(f"{text!r} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise BadValue("expected a JSON object like '{\"lr\": 0.1}'")
        return value
    if isinstance(base, type) and issubclass(base, enum.Enum):
        try:
            return base(text)
        except ValueError:
            raise BadValue(f"{text!r} is not one of {[m.value for m in base]}") from None
    return text


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
