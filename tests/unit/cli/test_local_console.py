"""What ``rpcps local`` says on its console (cli.exits, cli.progress, cli.console): pure logic over exit codes, logs and scrapes."""

from __future__ import annotations

import io
import signal
from pathlib import Path

from cli import exits, progress
from cli.console import Console


def test_exits_a_restart_cannot_fix_are_final() -> None:
    assert not exits.restartable(2) and not exits.restartable(5)
    assert exits.restartable(1) and exits.restartable(3) and exits.restartable(-signal.SIGKILL)
    assert exits.describe(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exits.describe(2).startswith("exited with 2 (a bad flag or setting")
    assert exits.describe(7) == "exited with 7"


def test_error_lines_are_the_ones_that_state_the_error(tmp_path: Path) -> None:
    log = tmp_path / "worker0.log"
    log.write_text(
        "2026-12-01 10:00:00,000 INFO [worker0 pid 1] worker.runner: joining\n"
        "2026-12-01 10:00:01,000 ERROR [worker0 pid 1] worker.runner: slot taken over\n"
        "rpcps worker: error: --data 'm:d' returned int, expected an iterable of (inputs, targets) batches\n"
    )
    assert exits.error_lines(log) == [
        "2026-12-01 10:00:01,000 ERROR [worker0 pid 1] worker.runner: slot taken over",
        "rpcps worker: error: --data 'm:d' returned int, expected an iterable of (inputs, targets) batches",
    ]
    crashed = tmp_path / "ps.log"
    crashed.write_text('Traceback (most recent call last):\n  File "x.py", line 1\nZeroDivisionError: division by zero\n')
    assert exits.error_lines(crashed) == ["ZeroDivisionError: division by zero"]
    assert exits.error_lines(tmp_path / "missing.log") == []


def test_a_progress_line_says_only_what_is_known() -> None:
    nothing = progress.Progress(elapsed_s=0.0, version=None, rate=None, steps_held=None, steps_total=600, loss=None,
                                live_workers=None, held_out=None).line()
    assert nothing == "[   0.0s] model version -, loss -, live workers -"
    assert "nan" not in nothing and "0.0000" not in nothing
    some = progress.Progress(elapsed_s=3.0, version=450, rate=150.0, steps_held=300, steps_total=600, loss=1.25,
                             live_workers=2, held_out=(0.5, 440)).line()
    assert some == ("[   3.0s] steps 300/600 (50%), model version 450 (150.0 updates/s), loss 1.2500, live workers 2, "
                    "held-out loss 0.5000 at version 440")


def test_placeholders_of_unscored_gauges_are_not_shown() -> None:
    assert progress.worker_loss([{"rpcps_worker_loss": 0.0, "rpcps_worker_steps_total": 0.0}, {}]) is None
    assert progress.worker_loss([{"rpcps_worker_loss": 1.0, "rpcps_worker_steps_total": 5.0},
                                 {"rpcps_worker_loss": 3.0, "rpcps_worker_steps_total": 1.0}]) == 2.0
    assert progress.held_out({"rpcps_evaluator_loss": 0.0, "rpcps_evaluator_model_version": 0.0,
                              "rpcps_evaluator_evaluations_total": 0.0}) is None
    assert progress.held_out({"rpcps_evaluator_loss": 0.25, "rpcps_evaluator_model_version": 9.0,
                              "rpcps_evaluator_evaluations_total": 2.0}) == (0.25, 9)


def test_resume_is_read_from_the_servers_newest_resume_line() -> None:
    tail = ("... ps.runner: resumed from /tmp/c/step-100 at version 100\n"
            "... ps.runner: resumed from /tmp/c/step-2984 at version 2984\n")
    assert progress.resumed_from(tail) == (2984, "step-2984")
    assert progress.resumed_from("... ps.runner: serving on 127.0.0.1:1 as ps0_r0\n") is None
    assert progress.serving("INFO [ps0 pid 7] ps.runner: serving on 127.0.0.1:29500 as ps0_r0 (send SIGTERM or Ctrl-C to stop)")
    # Every server but a shard 0 that hosts the store names the group it joined (local waits for each to serve).
    assert progress.serving("INFO [ps1 pid 8] ps.runner: serving on the group of 127.0.0.1:29500 as ps1_r0 (send SIGTERM or Ctrl-C to stop)")
    assert not progress.serving(tail)
    assert progress.resume_notice("ps", 2984, "step-2984") == "rpcps local: ps resumed from version 2984 (snapshot step-2984)"


def test_the_last_line_counts_the_model_version_and_shows_the_held_out_score() -> None:
    summary = {"wall_seconds": 10.0, "model_version": 8000, "updates_this_run": 5016, "initial_loss": 2.0, "final_loss": 0.5}
    evaluator = {"model_version": 8000, "last": {"accuracy": 0.9, "loss": 0.25}}
    assert progress.final_line(summary, evaluator) == (
        "rpcps local: done in 10.0s: model version 8000 (5016 updates in this run), loss 2.0000 -> 0.5000, "
        "501.6 updates/s; held-out loss 0.2500, accuracy 0.9000 at version 8000"
    )
    idle = {"wall_seconds": 7.1, "model_version": 600, "updates_this_run": 0, "initial_loss": None, "final_loss": None}
    assert progress.final_line(idle, None) == "rpcps local: done in 7.1s: model version 600 (0 updates in this run)"
    assert "already holds 300 steps for each of the 2 worker(s)" in progress.nothing_left("/tmp/d", 300, 2, 600)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _line(steps_held: int | None) -> progress.Progress:
    return progress.Progress(elapsed_s=3.0, version=450, rate=150.0, steps_held=steps_held, steps_total=600, loss=1.25,
                             live_workers=2, held_out=None)


def test_on_a_terminal_progress_is_a_bar_and_other_lines_go_above_it() -> None:
    out = _Terminal()
    console = Console(600, out)
    assert console.has_bar
    console.progress(_line(300))
    drawn = out.getvalue().split("\r")[-1]
    assert " 50%|" in drawn and "| 300/600 steps [" in drawn, drawn
    assert drawn.endswith("model version 450 (150.0 updates/s), loss 1.2500, live workers 2"), drawn
    console.say("rpcps local: ps resumed from version 120 (snapshot step-120)")
    assert "rpcps local: ps resumed from version 120 (snapshot step-120)\n" in out.getvalue()
    assert "300/600 steps" in out.getvalue().split("rpcps local: ps resumed")[-1], "the bar is drawn again below the line"
    console.progress(_line(240))  # a server that resumed from an older snapshot holds fewer steps: the bar goes back
    assert "| 240/600 steps [" in out.getvalue().split("\r")[-1]
    console.close()
    assert out.getvalue().endswith("\n"), "the next line starts below the bar"


def test_elsewhere_progress_is_a_plain_line_of_its_own() -> None:
    out = io.StringIO()  # a pipe, a file, a CI log
    console = Console(600, out)
    assert not console.has_bar
    console.progress(_line(300))
    console.say("rpcps local: checkpoints in /tmp/c")
    console.close()
    assert out.getvalue() == (
        "[   3.0s] steps 300/600 (50%), model version 450 (150.0 updates/s), loss 1.2500, live workers 2\n"
        "rpcps local: checkpoints in /tmp/c\n"
    )
    assert not Console(0, _Terminal()).has_bar, "no total, no bar"
