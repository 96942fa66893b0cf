"""The must-run list: tests that CI must run, so that a skip there is a failure, not a quiet gap.

Some tests skip themselves when the machine lacks what they need (root, ``ip netns``, a tmpfs,
Prometheus, shellcheck, a certificate tool, the grpcio-tools that generated the committed code). On a
laptop that is fine; in CI, which installs all of it (``tools/setup.sh --test``), such a skip means
coverage silently went missing. ``.ci/run`` passes ``--must-run tests/must_run.txt``; with it, the
hook in ``tests/conftest.py`` turns a skip of a listed test into a failure that names the reason.

The file holds one node id per line (``#`` starts a comment). A line names that node and everything
below it: ``tests/x.py`` every test in the file, ``tests/x.py::test_y`` every parameter of it,
``tests/x.py::test_y[a]`` one. A line that names no collected test while its file was collected (or
whose file does not exist) is an error: a renamed test must not fall off the list unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MustRunList:
    source: Path
    node_ids: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> MustRunList:
        """Raises OSError when the file cannot be read."""
        lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
        return cls(path, tuple(line for line in lines if line))

    def covers(self, node_id: str) -> bool:
        return any(_below(node_id, listed) for listed in self.node_ids)

    def stale(self, collected: Iterable[str], rootdir: Path) -> list[str]:
        """Listed node ids that name no collected test although their file was collected or is gone."""
        collected = list(collected)
        files = {node_id.split("::", 1)[0] for node_id in collected}
        return [
            listed for listed in self.node_ids
            if not any(_below(node_id, listed) for node_id in collected)
            and (_file(listed) in files or not (rootdir / _file(listed)).exists())
        ]


def _below(node_id: str, listed: str) -> bool:
    return node_id == listed or node_id.startswith((f"{listed}::", f"{listed}["))


def _file(listed: str) -> str:
    return listed.split("::", 1)[0]
