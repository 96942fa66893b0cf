#!/usr/bin/env python3
"""The one entry point of rpcps: ``python trainer_entry.py {ps,worker,local,ctl} ...`` (or ``rpcps ...``).

Thin on purpose: it hands the command line to ``cli.main`` and ends the process with its code
(``rpcps.fast_exit``: without the interpreter's 1-2 s teardown of torch). Nothing but the `rpcps`
console script imports this file.
"""

from typing import NoReturn

from cli.main import main as run
from rpcps.fast_exit import exit_now

__all__ = ["main"]  # the `rpcps` console script


def main() -> NoReturn:
    exit_now(run())


if __name__ == "__main__":
    main()
