"""The one entry point of rpcps: ``python trainer_entry.py {ps,worker,local} ...`` (or ``rpcps ...``).

Thin on purpose: it hands the command line to ``rpcps.cli``. Nothing imports this file.
"""

import sys

from rpcps import cli


def main() -> int:
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
