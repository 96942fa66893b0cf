"""bench.cpu_split's steady-part arithmetic and its context-switch reading."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.cpu_split import context_switches, steady_split

pytestmark = pytest.mark.timeout(30)


def test_the_steady_part_gives_cpu_and_switches_per_update_and_the_cores_kept_busy() -> None:
    # 100 updates over 10 s; between 15 % and 85 % (updates 20..80, t=2..8): 60 updates in 6 s.
    rows = [
        (0.0, {"ps": (0.0, 0), "worker0": (0.0, 0)}, 0.0),
        (2.0, {"ps": (1.0, 1000), "worker0": (0.5, 500)}, 20.0),
        (8.0, {"ps": (4.0, 4000), "worker0": (3.5, 2300)}, 80.0),
        (10.0, {"ps": (5.0, 5000), "worker0": (4.5, 3000)}, 100.0),
    ]
    split = steady_split(rows)
    assert split.updates_per_s == pytest.approx(10.0)
    assert split.cpu_ms_per_update == pytest.approx({"ps": 50.0, "worker0": 50.0})
    assert split.switches_per_update == pytest.approx({"ps": 3000 / 60, "worker0": 1800 / 60})
    assert split.cores_busy == pytest.approx(1.0)  # 10 updates/s x 100 ms of CPU each


def test_too_few_samples_in_the_steady_part_say_what_to_change() -> None:
    rows = [(0.0, {}, 0.0), (10.0, {}, 100.0)]
    with pytest.raises(RuntimeError, match="--interval-s"):
        steady_split(rows)


def test_context_switches_count_this_process_and_none_for_a_process_that_is_gone() -> None:
    assert context_switches(os.getpid()) > 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert context_switches(gone.pid) == 0
