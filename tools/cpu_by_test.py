"""Where a test run's CPU goes: runs a command, samples every process on the host, and sums their
CPU time by the test that started them (issue 25: "measure where the time goes").

    .venv/bin/python tools/cpu_by_test.py [--interval-s 1] [--top 40] -- .venv/bin/python -m pytest ...

A process is counted under the test whose pytest temporary directory (``popen-gwN/<test>``) its
command line names (``--run-dir``, ``--summary-json``, ...) or its standard output or error is
written to (``harness.procs`` logs each process there), else under "(no test directory)" (the xdist
workers with the unit tests they run in-process, the fork servers, tools whose output a pipe takes). Its CPU is what /proc says at its
last sample less what it had used when the run began, so a process that lived less than one
interval is missed or undercounted. Besides the
table it prints how busy the host was over the run (all CPU time on the host, from /proc/stat,
divided by the cores and the wall time), the figure that says whether more xdist workers could
help: at about 100 % only less work makes the run shorter.

Linux only (/proc); measurement, not part of the product or of any test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

_TEST_DIR = re.compile(r"popen-gw\d+/([^/\s]+)")
_NO_TEST = "(no test directory)"
_TICKS = os.sysconf("SC_CLK_TCK")


def _host_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat's first line)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


_COMMAND_CHARS = 110
"""How much of a process's command line ``--unassigned`` shows."""


def _test_of(proc: str) -> tuple[str, str]:
    """The test directory named by a process's command line or by where its output goes, and the
    command line itself (shortened)."""
    command = " ".join(Path(proc, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split())
    where = [command]
    for fd in ("1", "2"):
        try:
            where.append(os.readlink(Path(proc, "fd", fd)))
        except OSError:
            continue
    for text in where:
        if match := _TEST_DIR.search(text):
            return match.group(1), command[:_COMMAND_CHARS]
    return _NO_TEST, command[:_COMMAND_CHARS]


Seen = dict[tuple[int, int], tuple[str, float, str]]
"""Per (pid, start time): test directory, CPU seconds so far, command line."""


def _sample(seen: Seen) -> None:
    """Records every process's test directory and CPU seconds so far, keyed by (pid, start time)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            key = (int(entry.name), int(fields[19]))  # starttime tells a reused pid apart
            name, command = (seen[key][0], seen[key][2]) if key in seen else _test_of(entry.path)
            seen[key] = (name, (int(fields[11]) + int(fields[12])) / _TICKS, command)
        except (OSError, ValueError, IndexError):
            continue  # it exited while being read


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval-s", type=float, default=1.0, help="how often every process is sampled")
    parser.add_argument("--top", type=int, default=40, help="how many tests to list, most CPU first")
    parser.add_argument("--unassigned", type=int, default=0, metavar="N",
                        help=f"also list the N processes counted under {_NO_TEST!r} that used the most CPU, with their command lines")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: Seen = {}
    _sample(seen)
    before = {key: cpu for key, (_, cpu, _) in seen.items()}  # what processes older than the run had used
    busy0, total0 = _host_busy_ticks()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        _sample(seen)
        try:
            child.wait(timeout=args.interval_s)
        except subprocess.TimeoutExpired:
            pass
    wall = time.monotonic() - started
    busy1, total1 = _host_busy_ticks()
    by_test: dict[str, float] = defaultdict(float)
    processes: dict[str, int] = defaultdict(int)
    unassigned: list[tuple[float, int, str]] = []
    for key, (name, cpu, command) in seen.items():
        used = cpu - before.get(key, 0.0)
        if used > 0:
            by_test[name] += used
            processes[name] += 1
            if name == _NO_TEST:
                unassigned.append((used, key[0], command))
    counted = sum(by_test.values())
    print(f"\nwall {wall:.0f} s; host busy {100 * (busy1 - busy0) / max(1, total1 - total0):.0f} % of "
          f"{os.cpu_count()} cores; sampled processes {len(seen)}, {counted:.0f} CPU-s", file=sys.stderr)
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>5}  test directory", file=sys.stderr)
    for name, cpu in sorted(by_test.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{cpu:8.1f} {100 * cpu / max(counted, 1e-9):5.1f}% {processes[name]:5d}  {name}", file=sys.stderr)
    if args.unassigned:
        print(f"\n{'CPU-s':>8} {'pid':>7}  command line of a process under {_NO_TEST}", file=sys.stderr)
        for cpu, pid, command in sorted(unassigned, reverse=True)[: args.unassigned]:
            print(f"{cpu:8.1f} {pid:7d}  {command}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
