"""Reading and creating the one-line secret files rpcps uses (the control token, the job secret).

Secrets come from files, never from flags: a command line is visible to every user in ``ps``, and
an environment variable shows up in ``docker inspect``, ``kubectl describe`` and every child
process. A file can be mode 0600 or a mounted Secret.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)


def read_secret_line(path: str, what: str) -> str:
    """Reads a secret file: one line of printable text without spaces; surrounding whitespace is ignored.

    Args:
        what: how messages name the file ("token file", "job secret file").

    Raises:
        OSError: the file cannot be read (the message names the file).
        ValueError: the file is empty or holds more than one word.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise OSError(f"cannot read {what} {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text: {e}") from e
    value = text.strip()
    if not value:
        raise ValueError(f"{what} {path} is empty; write a random value into it, e.g. `openssl rand -hex 32 > {path}`")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{what} {path} must hold one token on one line, without spaces or control characters")
    return value


def warn_if_readable_by_others(path: str) -> None:
    """Logs a warning when a secret file can be read by group or others (like ssh does for keys)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("secret file %s is readable by other users; run `chmod 600 %s`", path, path)


def create_secret_file(path: Path) -> None:
    """Writes a fresh random secret (64 hex digits) to ``path``, readable by this user only.

    The file is created with mode 0600 from the start (never world-readable for an instant) and
    must not exist yet.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
