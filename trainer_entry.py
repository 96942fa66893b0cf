#!/usr/bin/env python3
"""The one entry point of rpcps: ``python trainer_entry.py {ps,worker,local,ctl} ...`` (or ``rpcps ...``).

Thin on purpose: it hands the command line to ``cli.main``. Nothing but the `rpcps` console script imports this file.
"""

import sys

from cli.main import main

__all__ = ["main"]  # the `rpcps` console script

if __name__ == "__main__":
    sys.exit(main())
