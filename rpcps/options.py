"""Command-line options generated from the settings the config classes declare (``rpcps.settings``).

One precedence for every role:

    command-line flag  >  RPCPS_<NAME> environment variable  >  torchrun's variable  >  default

``--help`` shows every setting's default and the variables it reads, grouped by config.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rpcps.settings import BadValue, Declared


def add_settings(parser: argparse.ArgumentParser, settings: Sequence[Declared]) -> None:
    """Adds one option per distinct flag, under its config's heading."""
    groups: dict[str, Any] = {}
    seen: set[str] = set()
    for d in settings:
        if d.flag in seen:
            continue
        seen.add(d.flag)
        group = groups.get(d.group)
        if group is None:
            group = groups[d.group] = parser.add_argument_group(d.group[:1].lower() + d.group[1:]) if d.group else parser  # keep file names as written
        sources = f"env {d.env}"
        alias = d.setting.torchrun
        if isinstance(alias, str):
            sources += f", then {alias}"
        elif alias is not None:
            sources += ", then torchrun's variables"
        default = "" if d.default is None else f"default {d.show(d.default)}; "
        group.add_argument(
            d.flag,
            dest=d.dest,
            type=_converter(d),
            default=None,
            choices=None,  # checked by the converter, so env values get the same message
            metavar=d.setting.metavar or ("{" + ",".join(d.choices) + "}" if d.choices else None),
            help=f"{d.setting.help} ({default}{sources})",
        )


def _converter(d: Declared) -> Any:
    def convert(text: str) -> Any:
        try:
            return d.parse(text)
        except BadValue as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = d.dest  # argparse names it in "invalid <name> value" messages
    return convert


def resolve(
    args: argparse.Namespace,
    settings: Sequence[Declared],
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
) -> dict[tuple[str, ...], Any]:
    """Every setting's value by field path, from flag, environment, torchrun or default, in that order.

    Settings that share a flag (``local`` passes one --model to server and workers) get the same value.
    """
    environ = os.environ if environ is None else environ
    values: dict[tuple[str, ...], Any] = {}
    for d in settings:
        value = getattr(args, d.dest, None)
        if value is None:
            raw, source = environ.get(d.env), d.env
            if raw is None:
                alias = d.setting.torchrun
                raw, source = d.torchrun_value(environ), alias if isinstance(alias, str) else "torchrun's variables"
            if raw is not None:
                try:
                    value = d.parse(raw)
                except BadValue as e:
                    parser.error(f"{source}={raw!r} is not a valid value for {d.flag}: {e}")
        values[d.path] = d.default if value is None else value
    return values
