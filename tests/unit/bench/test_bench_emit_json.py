"""bench.common.emit_json writes a whole line to a pipe even while signals interrupt its writes."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest

from bench.common import emit_json

pytestmark = pytest.mark.timeout(60)


class _Stdout:
    """Just enough of sys.stdout for emit_json: a flush and the pipe's write end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.fd


def test_a_long_line_arrives_whole_while_a_timer_interrupts_the_blocked_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = {"update_times": [i / 7 for i in range(400_000)]}  # ~8 MB: the 64 KiB pipe fills many times over
    read_end, write_end = os.pipe()
    received = bytearray()

    def read_all() -> None:
        while chunk := os.read(read_end, 1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    interrupts: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, _frame: interrupts.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    try:
        monkeypatch.setattr(sys, "stdout", _Stdout(write_end))
        emit_json(payload)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(write_end)
    reader.join(timeout=30)
    os.close(read_end)
    assert not reader.is_alive()
    assert interrupts, "the timer never fired during the write: the test proved nothing"
    assert received.endswith(b"\n") and received.count(b"\n") == 1
    assert json.loads(received) == payload


def test_an_in_memory_stdout_gets_the_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    emit_json({"steps": 4, "loss": 0.5})
    assert capsys.readouterr().out == '{"steps": 4, "loss": 0.5}\n'
