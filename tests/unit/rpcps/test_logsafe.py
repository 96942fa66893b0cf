"""``rpcps.logsafe.peer_text``: what a peer sends cannot start, rewrite or flood a log line."""

from __future__ import annotations

import logging

import pytest

from rpcps.logsafe import DEFAULT_LIMIT, peer_text


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("worker0_r3", "worker0_r3"),  # real names are shown as they are
        ("x\nERROR ps: forged", "x\\nERROR ps: forged"),
        ("x\rERROR ps: forged", "x\\rERROR ps: forged"),
        ("x\r\n", "x\\r\\n"),
        ("\x1b[2K\x1b[1Agone", "\\x1b[2K\\x1b[1Agone"),  # ANSI: erase the line, move up
        ("a\x00b", "a\\x00b"),
        ("a\u2028b\u2029c", "a\\u2028b\\u2029c"),  # Unicode line and paragraph separators
        ("a\x85b\x0bc\x0cd", "a\\x85b\\x0bc\\x0cd"),  # NEL, vertical tab, form feed: str.splitlines() splits there
        ("a\tb", "a\\tb"),
        ("evil\u202eexe.txt", "evil\\u202eexe.txt"),  # a bidirectional override
        ("a\\nb", "a\\\\nb"),  # a literal backslash-n cannot pass for an escaped newline
        ("", ""),
        ("ünïcödé 名前", "ünïcödé 名前"),  # printable text stays readable
    ],
)
def test_strings_come_out_on_one_printable_line(raw: str, shown: str) -> None:
    assert peer_text(raw) == shown
    assert len(peer_text(raw).splitlines()) <= 1
    assert peer_text(raw).isprintable()


def test_a_long_value_is_cut_with_a_note_of_how_much() -> None:
    text = peer_text("x" * 10_000, limit=50)
    assert text == "x" * 50 + "...[9950 more characters]"
    assert len(peer_text("y" * 10_000)) < DEFAULT_LIMIT + 40


def test_the_limit_counts_escaped_characters_and_never_splits_an_escape() -> None:
    text = peer_text("\n" * 100, limit=9)  # each newline is two characters escaped
    assert text == "\\n" * 4 + "...[96 more characters]"


def test_a_huge_value_costs_no_more_than_its_limit() -> None:
    assert peer_text("\x00" * 10_000_000, limit=8) == "\\x00\\x00...[9999998 more characters]"


def test_a_str_subclass_counts_as_its_characters() -> None:
    class Sneaky(str):
        def __str__(self) -> str:
            return "ok\nERROR forged"

        def __repr__(self) -> str:
            return "ok\nERROR forged"

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter("ok\nERROR forged")

    assert peer_text(Sneaky("a\nb")) == "a\\nb"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (3, "3"),
        (None, "None"),
        (b"ab\n\x1b", "b'ab\\n\\x1b'"),  # repr's own escapes are kept as they are
        (["a\nb"], "['a\\nb']"),
        (("0\nERROR ps: forged",), "('0\\nERROR ps: forged',)"),
    ],
)
def test_other_values_are_shown_by_their_repr(value: object, shown: str) -> None:
    assert peer_text(value) == shown


def test_a_huge_container_is_not_rendered_in_full() -> None:
    text = peer_text(list(range(1_000_000)))
    assert text.startswith("[0, 1, 2") and len(text) < 100


def test_a_repr_that_raises_or_lies_does_not_break_the_log_call() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    class Lying:
        def __repr__(self) -> str:
            return "x\nERROR ps: forged"

    assert "Broken" in peer_text(Broken())
    assert peer_text(Lying()) == "x\\nERROR ps: forged"


def test_a_limit_below_one_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="limit"):
        peer_text("x", limit=0)


def test_a_forged_line_stays_inside_the_logged_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        logging.getLogger("ps.test").warning("refused %s", peer_text("x\nERROR ps: forged\r\u2028"))
    assert caplog.text.count("\n") == 1  # the record's own line end, nothing else
    assert not any(line.startswith("ERROR ps: forged") for line in caplog.text.splitlines())
