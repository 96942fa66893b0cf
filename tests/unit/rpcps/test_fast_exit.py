"""rpcps.fast_exit: the process ends with its code after what the interpreter's exit must still do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.procs import REPO, child_env

pytestmark = pytest.mark.timeout(60)

_CHILD = """
import atexit, concurrent.futures, sys, threading, time
from rpcps.fast_exit import exit_now

pool = concurrent.futures.ThreadPoolExecutor(2)  # never shut down: its idle workers must not hold the exit
pool.submit(lambda: None).result()
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
atexit.register(lambda: print("atexit ran"))
print("unflushed", end="")
exit_now(7)
"""


def test_exit_waits_for_threads_runs_atexit_flushes_and_keeps_the_code() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 7, done.stderr
    assert "thread finished" in done.stdout, "a non-daemon thread was cut short"
    assert done.stdout.endswith("atexit ran\n"), f"atexit handlers or the final flush did not run: {done.stdout!r}"
    assert "unflushed" in done.stdout
