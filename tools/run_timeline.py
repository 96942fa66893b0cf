"""When each test of a run ran, and the stretches where fewer ran side by side than there are workers
(issue 25: "measure where the time goes"). ``tools/cpu_by_test.py`` says what each test costs; this
says whether the workers were kept busy: a test that needs the host to itself (``slow``) or one long
test left at the end holds the others idle whatever the host's CPU says.

    PYTHONPATH=tools .venv/bin/python -m pytest -p run_timeline --timeline /tmp/timeline.jsonl
    .venv/bin/python tools/run_timeline.py /tmp/timeline.jsonl [--below 4] [--min-s 5]

As a pytest plugin (``-p run_timeline``, loaded by every xdist worker too) it appends one JSON line
per test to the ``--timeline`` file: the worker, the test and when its run began and ended (its
fixtures included, a wait for its turn not). As a script it prints how many tests ran at once,
second by second, and each stretch below ``--below`` at once that lasted ``--min-s`` or more, with
the tests that ran in it. Measurement, not part of the product or of any test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeline", metavar="FILE", default=None, help="append each test's worker, start and end here (JSON lines)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    path = item.config.getoption("--timeline")
    began = time.time()
    yield
    if path is not None:
        # xdist hands each worker its id in workerinput; the PYTEST_XDIST_WORKER variable would also name
        # the outer worker in a pytest run started by a test.
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
        line = {"worker": worker, "test": item.nodeid, "began": began, "ended": time.time()}
        with open(path, "a") as out:  # one short append per line: the workers' lines do not interleave
            out.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class Span:
    worker: str
    test: str
    began: float
    ended: float


def read_spans(path: Path) -> list[Span]:
    return [Span(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def running_per_second(spans: list[Span]) -> list[float]:
    """How many tests ran at once in each second of the run (fractions where one began or ended)."""
    start = min(s.began for s in spans)
    seconds = [0.0] * (int(max(s.ended for s in spans) - start) + 1)
    for span in spans:
        began, ended = span.began - start, span.ended - start
        for second in range(int(began), min(int(ended) + 1, len(seconds))):
            seconds[second] += max(0.0, min(ended, second + 1) - max(began, second))
    return seconds


def thin_stretches(seconds: list[float], below: float, min_s: int) -> list[tuple[int, int]]:
    """[first, last + 1) ranges of at least ``min_s`` seconds in which fewer than ``below`` tests ran."""
    stretches, first = [], None
    for second, running in enumerate([*seconds, below]):  # a sentinel ends a stretch still open
        if running < below and first is None:
            first = second
        elif running >= below and first is not None:
            if second - first >= min_s:
                stretches.append((first, second))
            first = None
    return stretches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path, help="the file a run wrote with --timeline")
    parser.add_argument("--below", type=float, default=4.0, help="report stretches with fewer tests than this at once (the workers)")
    parser.add_argument("--min-s", type=int, default=5, help="and at least this long")
    args = parser.parse_args(argv)
    spans = read_spans(args.timeline)
    if not spans:
        print(f"{args.timeline} holds no test", file=sys.stderr)
        return 2
    seconds = running_per_second(spans)
    start = min(s.began for s in spans)
    stretches = thin_stretches(seconds, args.below, args.min_s)
    print(f"{len(spans)} tests over {len(seconds)} s; tests at once, mean {sum(seconds) / len(seconds):.2f}")
    for first, last in stretches:
        print(f"{first:5d}-{last:<5d} s: {sum(seconds[first:last]) / (last - first):.1f} at once")
        for span in sorted(spans, key=lambda s: s.began):
            if span.ended - start > first and span.began - start < last:
                print(f"    {span.worker:>4} {span.began - start:6.1f}-{span.ended - start:<6.1f} {span.test}")
    lost = sum(max(0.0, args.below - s) for s in seconds)
    print(f"{len(stretches)} stretch(es) below {args.below:g} at once for {args.min_s} s or more; "
          f"{lost:.0f} worker-seconds idle over the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
