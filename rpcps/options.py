"""Command-line options with one precedence for every role:

    command-line flag  >  RPCPS_<NAME> environment variable  >  torchrun's variable  >  default

Each option is declared once; ``--help`` shows its default and the variables it reads.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    torchrun: str | None = None
    """torchrun variable used when neither the flag nor RPCPS_* is set."""
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "RPCPS_" + self.dest.upper()


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for o in options:
        sources = f"env {o.env}" + (f", then {o.torchrun}" if o.torchrun else "")
        default = "" if o.default is None else f"default {o.default}; "
        parser.add_argument(
            o.flag,
            type=o.type,
            default=None,
            choices=o.choices,
            metavar=o.metavar,
            help=f"{o.help} ({default}{sources})",
        )


def resolve(args: argparse.Namespace, options: Sequence[Option], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Fills every option from flag, environment, torchrun or default, in that order."""
    values: dict[str, Any] = {}
    for o in options:
        value = getattr(args, o.dest)
        source = o.flag
        if value is None:
            raw, source = os.environ.get(o.env), o.env
            if raw is None and o.torchrun:
                raw, source = os.environ.get(o.torchrun), o.torchrun
            if raw is not None:
                try:
                    value = o.type(raw)
                except (TypeError, ValueError) as e:
                    parser.error(f"{source}={raw!r} is not a valid value for {o.flag}: {e}")
                if o.choices and value not in o.choices:
                    parser.error(f"{source}={raw!r}: choose one of {list(o.choices)}")
        values[o.dest] = o.default if value is None else value
    return values


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value a converter refuses. argparse prints an ArgumentTypeError's message as it is (a plain
    ValueError becomes "invalid positive_int value"), and ``resolve`` catches it as a ValueError."""


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise BadValue(f"{text!r} is not HOST:PORT")
    number = _number(int, port)
    if not 0 <= number <= 65535:
        raise BadValue(f"port {number} is out of range")
    return host.strip("[]"), number


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise BadValue(f"{value} is not >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise BadValue(f"{value} is not >= 0")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if not value > 0:
        raise BadValue(f"{value} is not > 0")
    return value


def _number(kind: type[int | float], text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise BadValue(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise BadValue(f"{text!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise BadValue("expected a JSON object like '{\"lr\": 0.1}'")
    return value
