"""Why a child of ``rpcps local`` exited, whether restarting it can help, and the lines of its log that say so.

Pure logic over an exit status and a log file; ``cli.local`` decides and prints. Nothing here starts,
signals or waits for a process.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

FINAL_EXITS: dict[int, str] = {
    2: "a bad flag or setting, or a refused resume",
    5: "refused by the server: another model, a slot out of range or taken over, or no valid job secret",
}
"""Exit statuses a restart cannot fix (docs/FAULT_TOLERANCE.md, "Exit codes"): the same command line
fails the same way again, so ``local`` stops at once and shows why instead of retrying."""

_ERROR_LINE = re.compile(r"^rpcps \w+: error: | (ERROR|CRITICAL) \[")
_TAIL_BYTES = 64 * 1024


def restartable(code: int) -> bool:
    """Whether running the same command line again may succeed (a crash, a kill, a lost server)."""
    return code not in FINAL_EXITS


def describe(code: int) -> str:
    """How a child ended, for people: "exited with 2 (a bad flag ...)", "was killed by SIGKILL"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    reason = FINAL_EXITS.get(code)
    return f"exited with {code}" + (f" ({reason})" if reason else "")


def error_lines(log_path: Path, limit: int = 3) -> list[str]:
    """The last ``limit`` lines of a child's log that state an error, without the log's prefix noise.

    Those are the one-line errors every role prints (``rpcps ROLE: error: ...``) and ERROR records of
    its logger; when there is none, the last line of a Python traceback (``SomeError: message``).
    Empty when the log is missing or says nothing of the kind.
    """
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - _TAIL_BYTES, 0))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    errors = [line.strip() for line in lines if _ERROR_LINE.search(line)]
    if not errors:
        errors = [line.strip() for line in lines if re.match(r"^\w+(\.\w+)*(Error|Exception): ", line)]
    return [_clip(line) for line in errors[-limit:]]


def _clip(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."
