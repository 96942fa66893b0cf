"""tools/cpu_by_test.py counts a process's CPU under the test directory its command line names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "tools" / "cpu_by_test.py"
BUSY = "import time; end = time.process_time() + 1.5\nwhile time.process_time() < end: pass"


@pytest.mark.timeout(60)
def test_a_busy_child_is_counted_under_its_test_directory(tmp_path: Path) -> None:
    named = "/nonexistent/popen-gw0/test_something_busy0/run"  # not under tmp_path, which names its own test
    run = subprocess.run(
        [sys.executable, str(TOOL), "--interval-s", "0.2", "--", sys.executable, "-c", BUSY, named],
        capture_output=True, text=True, timeout=50, check=False,
    )
    assert run.returncode == 0, run.stderr
    rows = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s*([\d.]+)\s+[\d.]+%\s+\d+\s+(\S.*)$", run.stderr, re.MULTILINE)}
    assert rows.get("test_something_busy0", 0.0) >= 1.0, run.stderr
    assert re.search(r"host busy \d+ % of \d+ cores", run.stderr), run.stderr


def test_a_command_is_required() -> None:
    run = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 2 and "give the command to run after --" in run.stderr


@pytest.mark.timeout(60)
def test_unassigned_lists_the_busiest_processes_without_a_test_directory_with_their_command_lines() -> None:
    run = subprocess.run(
        [sys.executable, str(TOOL), "--interval-s", "0.2", "--unassigned", "3", "--", sys.executable, "-c", BUSY, "no-test-here"],
        capture_output=True, text=True, timeout=50, check=False,
    )
    assert run.returncode == 0, run.stderr
    listed = re.findall(r"^\s*([\d.]+)\s+\d+\s+(.* -c import time; end = .*)$", run.stderr, re.MULTILINE)
    assert listed and float(listed[0][0]) >= 1.0, run.stderr
