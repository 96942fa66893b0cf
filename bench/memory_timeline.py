"""A fine RSS timeline of a ``local`` run's server and workers, and where its peaks come from (not a test).

``bench.common`` reads memory every 0.5 s together with the /metrics scrapes, which says how high
RSS got but not when. Here a thread reads only ``/proc/<pid>/status`` (VmRSS) of shard 0 and every
worker every 0.1 s, and ``teeth`` splits each series into windows of the malloc trim interval
counted from the first applied update: the first window (with everything before it) is start-up,
the rest are steady state. With a trim every few seconds RSS is a sawtooth: the lowest point of a
window is about the live data (just after a trim), the highest is that plus the free heap pages
faulted in again before the next trim. A start-up transient shows as a first window above the
steady windows' tops.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import proc_memory_kb
from rpcps.periodic import Periodic

INTERVAL_S = 0.1


class RssSampler:
    """Samples VmRSS (MB) of the processes ``local`` lists in ``run_dir/children.json`` (shard 0 as
    ``ps``, the workers by name) every ``interval_s``, on a daemon thread, until ``stop``."""

    def __init__(self, run_dir: Path, interval_s: float = INTERVAL_S) -> None:
        self._children = run_dir / "children.json"
        self.started = time.monotonic()
        self.series: dict[str, list[tuple[float, float]]] = {}
        """Process name -> (seconds since ``started``, VmRSS in MB)."""
        self._pids: dict[str, int] = {}
        self._task = Periodic("rss-sampler", interval_s, self._sample)

    def start(self) -> None:
        self._task.start()

    def stop(self) -> None:
        self._task.stop()

    def _sample(self) -> None:
        try:  # rewritten as children start: read until every one of them has a pid
            info = json.loads(self._children.read_text())
            self._pids = {n: c["pid"] for n, c in info.items() if (n == "ps" or n.startswith("worker")) and c.get("pid")}
        except (OSError, ValueError):
            pass
        now = time.monotonic() - self.started
        for name, pid in self._pids.items():
            mem = proc_memory_kb(pid)
            if mem is not None:
                self.series.setdefault(name, []).append((now, mem[0] / 1024))

    def write_tsv(self, path: Path) -> None:
        """One line per sample: seconds, process name, VmRSS in MB."""
        rows = sorted((t, name, mb) for name, xs in self.series.items() for t, mb in xs)
        path.write_text("".join(f"{t:.2f}\t{name}\t{mb:.0f}\n" for t, name, mb in rows))


@dataclass(frozen=True)
class Teeth:
    """One process's RSS (MB) split into start-up and steady windows (``teeth``)."""

    peak: float
    peak_s: float
    """When the peak was first sampled (seconds since the sampler started)."""
    startup_top: float
    """The highest sample before the first steady window."""
    tops: list[float]
    """Each steady window's highest sample."""
    lows: list[float]
    """Each steady window's lowest sample."""

    @property
    def transient(self) -> float:
        """How far start-up rose above the highest steady window (MB; <= 0: not above)."""
        return self.startup_top - max(self.tops, default=0.0)


def teeth(samples: list[tuple[float, float]], first_update_s: float, window_s: float, until_s: float | None = None) -> Teeth:
    """Splits (seconds, MB) samples into the start-up window (up to ``first_update_s + window_s``)
    and steady windows of ``window_s`` after it; samples after ``until_s`` (the shutdown) are left out.

    Raises:
        ValueError: no sample, or no steady window (the run was shorter than start-up and one window).
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    kept = [(t, mb) for t, mb in samples if until_s is None or t <= until_s]
    if not kept:
        raise ValueError("no RSS sample: the process never started, or was sampled only after the run stopped")
    steady_from = first_update_s + window_s
    windows: dict[int, list[float]] = {}
    for t, mb in kept:
        if t >= steady_from:
            windows.setdefault(int((t - steady_from) // window_s), []).append(mb)
    if not windows:
        raise ValueError(f"no steady window: the run stopped before {steady_from:.1f} s; run it for longer")
    peak_s, peak = max(kept, key=lambda x: (x[1], -x[0]))
    return Teeth(
        peak=peak,
        peak_s=peak_s,
        startup_top=max((mb for t, mb in kept if t < steady_from), default=0.0),
        tops=[max(w) for _, w in sorted(windows.items())],
        lows=[min(w) for _, w in sorted(windows.items())],
    )


def table_row(name: str, th: Teeth, first_update_s: float) -> list[str]:
    """A row of ``bench.server_memory``'s timeline table (columns: ``TABLE_COLUMNS``)."""
    return [
        name,
        f"{th.peak:.0f} at {th.peak_s - first_update_s:+.1f} s",
        f"{th.startup_top:.0f} ({th.transient:+.0f})",
        f"{statistics.median(th.tops):.0f} / {max(th.tops):.0f}",
        f"{statistics.median(th.lows):.0f}",
    ]


TABLE_COLUMNS = [
    "process",
    "peak RSS (0.1 s samples), MB at s from the first update",
    "start-up top (above the steady tops)",
    "steady window tops, median / max",
    "steady window lows, median",
]
