"""Runs many ``rpcps`` command lines that should fail at start-up, each in a process of its own,
for the price of one interpreter start.

``python cli_batch.py OUT_DIR`` reads a JSON list of argument lists on stdin. It imports torch and
the roles' settings once, then forks one child per command line; the child points its stdout and
stderr at ``OUT_DIR/<n>.out`` and ``OUT_DIR/<n>.err`` and runs ``trainer_entry.main`` on that
command line, as ``python trainer_entry.py ARGS...`` would. Its last line of stdout is a JSON list
of the exit codes, in order (-SIGKILL for a child that outlived ``CHILD_TIMEOUT_S``).

Each such error costs an interpreter 2-3 s of CPU to import torch before it can say anything; a test
per bad flag that started its own would spend most of its time there (tests/integration/cli/test_cli_errors.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 40.0


def _run_child(argv: list[str], out: Path, err: Path) -> NoReturn:
    """In the forked child: ends it with the code the interpreter would have exited with."""
    code = 70  # not reached: each path below sets it
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        import trainer_entry

        # Both as `python trainer_entry.py ARGS` sets them: a supervising server restarts itself from orig_argv.
        sys.argv = [str(REPO / "trainer_entry.py"), *argv]
        sys.orig_argv = [sys.executable, *sys.argv]
        trainer_entry.main()  # ends the process itself once the role returns
    except SystemExit as e:  # argparse's usage errors, sys.exit(...): as the interpreter ends on them
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught error: the traceback the interpreter would print
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int) -> int:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


def main() -> None:
    out_dir = Path(sys.argv[1])
    cases: list[list[str]] = json.loads(sys.stdin.read())
    sys.path.insert(0, str(REPO))
    # What trainer_entry's main does before torch loads (it reads this once), done before the shared import.
    from cli.main import CPP_LOG_LEVEL_ENV

    os.environ.setdefault(CPP_LOG_LEVEL_ENV, "ERROR")
    import torch  # noqa: F401 - the import every child would otherwise repeat

    codes = []
    for n, argv in enumerate(cases):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(argv, out_dir / f"{n}.out", out_dir / f"{n}.err")
        codes.append(_wait(pid))
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
