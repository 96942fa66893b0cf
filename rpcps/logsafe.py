"""Peer-supplied text made safe to put in a log line: ``peer_text``.

A peer chooses the RPC names, worker slots and names it registers with, the names it asks to drop
or attach as, and (through the unauthenticated store) the names in views and member lists. Logged
raw, a newline in one of them starts a line of the attacker's choosing (``\\nERROR ps: ...``), a
carriage return or an ANSI escape rewrites what a terminal shows, and a megabyte-long name floods
the log. Every log call that formats such a value passes it through ``peer_text``; nothing else
(no HTML, shell or SQL quoting) is done here.
"""

from __future__ import annotations

import reprlib

DEFAULT_LIMIT = 200
"""Characters of escaped text kept by default: long enough for any real name."""
MESSAGE_LIMIT = 2000
"""For a whole error message that a peer sent or that quotes what a peer sent."""

_REPR = reprlib.Repr()
"""Bounds the work of showing a non-string value (a huge list is not rendered in full first)."""
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = DEFAULT_LIMIT


def peer_text(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """``value`` as one printable line of at most about ``limit`` characters, for a log line.

    A string is shown as its characters, with every character ``str.isprintable`` rejects escaped
    the way ``repr`` escapes it (``\\n``, ``\\r``, ``\\x00``, ``\\x1b``, ``\\u2028``, ``\\x85``,
    bidirectional overrides) and backslashes doubled, so an escaped newline cannot be faked with a
    literal backslash. No quotes are added: callers quote where the format needs it. Any other
    value is shown by a bounded ``repr`` (``reprlib``), whose own escapes are kept and anything
    unprintable left in it escaped the same way; a string subclass counts as its characters,
    whatever its ``__str__``/``__repr__``/``__iter__`` say. Text beyond ``limit`` escaped characters
    is cut, with ``...[N more characters]`` saying how much.

    Whatever ``value`` is, this does not raise: a value whose ``repr`` fails is shown by its type.

    Raises:
        ValueError: ``limit`` is below 1 (a programming error, not a peer's doing).
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    is_text = isinstance(value, str)
    text = str.__str__(value) if is_text else _bounded_repr(value)
    keep_backslash = not is_text  # a repr escaped its strings' backslashes already
    out: list[str] = []
    used = 0
    for index, char in enumerate(text):
        piece = char if char.isprintable() and (keep_backslash or char != "\\") else _escape(char)
        if used + len(piece) > limit:
            return "".join(out) + f"...[{len(text) - index} more characters]"
        out.append(piece)
        used += len(piece)
    return "".join(out)


def _escape(char: str) -> str:
    return "\\\\" if char == "\\" else repr(char)[1:-1]


def _bounded_repr(value: object) -> str:
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a hostile or broken __repr__ must not break the log call
        return f"<unprintable {type(value).__name__}>"
