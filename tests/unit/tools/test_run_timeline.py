"""tools/run_timeline.py: records when each test ran (a pytest plugin) and finds the stretches where
fewer ran at once than there are workers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.procs import REPO
from tests.pytest_run import run_pytest

TOOL = REPO / "tools" / "run_timeline.py"
_spec = importlib.util.spec_from_file_location("tools_run_timeline", TOOL)
assert _spec is not None and _spec.loader is not None
timeline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = timeline  # its dataclass looks its module up there
_spec.loader.exec_module(timeline)


def _span(worker: str, began: float, ended: float) -> object:
    return timeline.Span(worker, f"test_{worker}_{began}", began, ended)


def test_tests_at_once_are_counted_per_second_with_fractions_at_the_edges() -> None:
    spans = [_span("gw0", 100.0, 104.0), _span("gw1", 100.0, 101.5), _span("gw1", 101.5, 102.0)]
    assert timeline.running_per_second(spans) == [2.0, 2.0, 1.0, 1.0, 0.0]


def test_a_stretch_below_the_workers_is_reported_only_when_long_enough() -> None:
    seconds = [4.0, 4.0, 1.0, 1.0, 1.0, 4.0, 2.0, 4.0, 1.0, 1.0, 1.0]
    assert timeline.thin_stretches(seconds, below=4.0, min_s=3) == [(2, 5), (8, 11)]  # the one-second dip is not
    assert timeline.thin_stretches(seconds, below=4.0, min_s=4) == []


@pytest.mark.timeout(120)
def test_a_run_with_the_plugin_writes_a_line_per_test_and_the_script_reads_it(tmp_path: Path) -> None:
    out = tmp_path / "timeline.jsonl"
    run = run_pytest(
        tmp_path, "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
        "-p", "run_timeline", "--timeline", str(out), PYTHONPATH=str(REPO / "tools"),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["test"] for line in lines] == ["test_tiny.py::test_one", "test_tiny.py::test_two"]
    assert all(line["worker"] == "main" and line["ended"] >= line["began"] for line in lines)
    report = subprocess.run([sys.executable, str(TOOL), str(out), "--below", "2", "--min-s", "1"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert report.returncode == 0, report.stderr
    assert "2 tests over 1 s" in report.stdout and "1 stretch(es) below 2" in report.stdout, report.stdout


def test_an_empty_timeline_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    report = subprocess.run([sys.executable, str(TOOL), str(empty)], capture_output=True, text=True, timeout=60, check=False)
    assert report.returncode == 2 and "holds no test" in report.stderr
