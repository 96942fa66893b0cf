"""Every command in README.md and docs/ runs as written on a fresh machine after the README's setup.

The shell commands of every fenced ``bash``/``sh`` block (and every ``$ command`` line of a transcript)
are extracted. Each one that runs a tool the setup installs into ``.venv`` must name it there
(``.venv/bin/python``, ``.venv/bin/rpcps``): outside the venv there is no torch and no ``rpcps``. The
cheap ones are then run as far as they can be without starting training: every rpcps command line
without placeholders is parsed by the real parser (its flags and values are accepted), every
``python -c`` snippet compiles, and every ``python -m`` module exists.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.main import parse

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_TOOLS = ("rpcps", "python", "python3", "torchrun", "pytest", "pip")
"""What tools/setup.sh installs into .venv; a bare name runs the system's (or nothing)."""
ENTRY = "trainer_entry.py"
PLACEHOLDER = re.compile(r"^(\.\.\.|\[.*|.*\]|[A-Z][A-Z_]*(:\d+)?|.*=?[A-Z]{2,}[A-Z_]*|.*\$.*|.*<.*>.*)$")
"""Arguments a reader replaces (DIR, SERVER:29500, [--flag F], ..., $VAR, <x>): such a command is checked, not run."""


@dataclass(frozen=True)
class Command:
    where: str
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _split(block: str) -> list[str]:
    """A shell block's simple commands: continuations joined, comments dropped, split on ; && || | & and newlines."""
    commands, current, quote, redirected, i = [], [], "", False, 0
    while i < len(block):
        c = block[i]
        if redirected and not quote and c not in ";|&\n":  # a redirection's target is no argument
            i += 1
            continue
        if quote:
            current.append(c)
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
            current.append(c)
        elif c == "\\" and block[i + 1 : i + 2] == "\n":
            i += 1
            current.append(" ")
        elif c == "#" and (not current or current[-1] in " \t\n"):
            while i < len(block) and block[i] != "\n":
                i += 1
            continue
        elif c == ">":
            redirected = True
        elif c in ";|&\n":
            commands.append("".join(current))
            current, redirected = [], False
        else:
            current.append(c)
        i += 1
    commands.append("".join(current))
    return [c.strip() for c in commands if c.strip()]


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
            lang, body = m.group(1), m.group(2)
            line = text[: m.start(2)].count("\n") + 1
            if lang in ("bash", "sh"):
                sources = [body]
            else:  # a transcript: only its "$ command" lines
                sources = [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
            for source in sources:
                for command in _split(source):
                    argv = shlex.split(command)
                    if argv:
                        found.append(Command(f"{doc.relative_to(REPO)}:{line}", argv))
    return found


COMMANDS = documented_commands()


def test_the_docs_have_commands_to_check() -> None:
    assert len(COMMANDS) > 40, "the extraction found too few commands: did a fence change its form?"
    assert any(c.argv[:3] == [".venv/bin/python", "trainer_entry.py", "local"] for c in COMMANDS)


def test_every_command_of_a_venv_tool_names_the_venv() -> None:
    bare = [str(c) for c in COMMANDS if c.argv[0] in VENV_TOOLS]
    assert bare == [], "write .venv/bin/TOOL (tools/setup.sh installs them there, nowhere else):\n" + "\n".join(bare)


def _rpcps_argv(command: Command) -> list[str] | None:
    """The rpcps arguments of a command that runs rpcps (the console script or trainer_entry.py), else None."""
    argv = command.argv
    if argv[0] == ".venv/bin/rpcps":
        return argv[1:]
    if argv[0] == ".venv/bin/python" and argv[1:2] == [ENTRY]:
        return argv[2:]
    if argv[0] == ".venv/bin/torchrun" and ENTRY in argv:  # after torchrun's own options
        return argv[argv.index(ENTRY) + 1 :]
    return None


RUNNABLE = [c for c in COMMANDS if (a := _rpcps_argv(c)) is not None and not any(PLACEHOLDER.match(x) for x in a)]


@pytest.mark.parametrize("command", RUNNABLE, ids=str)
def test_every_rpcps_command_line_is_accepted_as_written(command: Command, capsys: pytest.CaptureFixture[str]) -> None:
    argv = _rpcps_argv(command)
    assert argv is not None
    try:
        parse(argv)
    except SystemExit as e:
        pytest.fail(f"{command}\nis refused (exit {e.code}): {capsys.readouterr().err}")


def test_commands_with_placeholders_still_name_real_roles() -> None:
    from cli.main import ROLES

    unknown = [str(c) for c in COMMANDS if (a := _rpcps_argv(c)) is not None and (not a or a[0] not in ROLES)]
    assert unknown == []
    assert len(RUNNABLE) >= 8, "most documented rpcps command lines should be runnable as written"


def test_every_python_snippet_compiles_and_every_module_exists() -> None:
    checked = 0
    for c in COMMANDS:
        if c.argv[0] != ".venv/bin/python":
            continue
        if c.argv[1] == "-c":
            compile(c.argv[2], str(c), "exec")
            checked += 1
        elif c.argv[1] == "-m" and c.argv[2] != "pytest":
            assert importlib.util.find_spec(c.argv[2]) is not None, f"{c}: no module {c.argv[2]}"
            checked += 1
    assert checked >= 5
