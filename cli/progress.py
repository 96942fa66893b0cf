"""What ``rpcps local`` prints about a run: its progress lines, the resume notice and the last line.

Pure formatting over what the children report (their /metrics, their summaries); ``cli.local``
gathers those and prints. Every field says only what is known: a value nobody has measured yet is
"-" or left out, never a placeholder such as ``nan`` or ``0.0000``. Counts come from the server's
model version, which survives a server restart (a resumed server goes on from its snapshot's
version), not from counters that restart at 0 with each process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESUMED_LINE = re.compile(r"resumed from (\S+) at version (\d+)")
"""The server's log line when it resumes from a snapshot (ps/runner.py ``_restore``): it names the snapshot."""
SERVING_LINE = re.compile(r"\bserving on (?:the group of )?\S+ as ")
"""The server's log line once it serves (ps/runner.py): restored if it resumed, its version no longer a default 0.
Shard 0 without a coordinator says where it listens; every other server, the group it joined."""


@dataclass(frozen=True)
class Progress:
    """One progress line's facts; None where nothing is known yet."""

    elapsed_s: float
    version: int | None
    """The model version shard 0's server reports (None while it does not answer)."""
    rate: float | None
    """Updates per second since the previous line (None for the first, or across a rollback)."""
    steps_held: int | None
    """Steps the servers hold summed over the slots (None while they do not answer)."""
    steps_total: int
    loss: float | None
    """The mean of the latest batch loss of the workers that computed a step."""
    live_workers: int | None
    held_out: tuple[float, int] | None
    """The evaluator's latest held-out loss and the version it scored, once it scored one."""

    def line(self) -> str:
        """The plain progress line: the time, the steps held, then ``status()``."""
        parts = [f"[{self.elapsed_s:6.1f}s]"]
        if self.steps_held is not None and self.steps_total > 0:
            parts.append(f"steps {self.steps_held}/{self.steps_total} ({100 * self.steps_held / self.steps_total:.0f}%),")
        return " ".join([*parts, self.status()])

    def status(self) -> str:
        """What the line says beyond the time and the steps (a progress bar shows those itself)."""
        text = f"model version {_int(self.version)}" + (f" ({self.rate:.1f} updates/s)," if self.rate is not None else ",")
        text += f" loss {_num(self.loss)}, live workers {_int(self.live_workers)}"
        if self.held_out is not None:
            text += f", held-out loss {self.held_out[0]:.4f} at version {self.held_out[1]}"
        return text


def worker_loss(scrapes: list[dict[str, float]]) -> float | None:
    """The mean latest loss over the workers that have computed at least one step (their gauge reads 0 before)."""
    losses = [m["rpcps_worker_loss"] for m in scrapes if m.get("rpcps_worker_steps_total", 0) > 0 and "rpcps_worker_loss" in m]
    return sum(losses) / len(losses) if losses else None


def held_out(scrape: dict[str, float]) -> tuple[float, int] | None:
    """The evaluator's latest score, once it has scored a model (its gauges read 0 before)."""
    if scrape.get("rpcps_evaluator_evaluations_total", 0) <= 0 or "rpcps_evaluator_loss" not in scrape:
        return None
    return scrape["rpcps_evaluator_loss"], int(scrape.get("rpcps_evaluator_model_version", 0))


def serving(log_tail: str) -> bool:
    """Whether a server's log says it serves (before that, its /metrics version is a default, not the model's)."""
    return SERVING_LINE.search(log_tail) is not None


def resumed_from(log_tail: str) -> tuple[int, str] | None:
    """The version and snapshot a server's log says it resumed from (its latest such line), or None."""
    found = RESUMED_LINE.findall(log_tail)
    if not found:
        return None
    path, version = found[-1]
    return int(version), Path(path).name


def resume_notice(name: str, version: int, snapshot: str | None) -> str:
    where = f" (snapshot {snapshot})" if snapshot else ""
    return f"rpcps local: {name} resumed from version {version}{where}"


def nothing_left(checkpoint_dir: str | None, steps: int, workers: int, version: int | None) -> str:
    """Why a run that trained nothing did nothing: its checkpoint already holds every step."""
    where = f"the checkpoint in {checkpoint_dir}" if checkpoint_dir else "the server"
    return (
        f"rpcps local: nothing left to train: {where} already holds {steps} steps for each of the {workers} worker(s) "
        f"(model version {_int(version)}); pass more --steps to train further, or a new --checkpoint-dir to start over"
    )


def final_line(summary: dict[str, Any], evaluator: dict[str, Any] | None) -> str:
    """The run's last line: the model version it reached, the losses, and the evaluator's final score."""
    version = summary.get("model_version")
    trained = summary.get("updates_this_run")
    text = f"rpcps local: done in {summary['wall_seconds']:.1f}s: model version {_int(version)}"
    if trained is not None and trained != version:
        text += f" ({trained} updates in this run)"
    if summary.get("initial_loss") is not None or summary.get("final_loss") is not None:  # a run that trained nothing has none
        text += f", loss {_num(summary.get('initial_loss'))} -> {_num(summary.get('final_loss'))}"
    if trained:
        text += f", {trained / summary['wall_seconds']:.1f} updates/s" if summary["wall_seconds"] > 0 else ""
    scores = (evaluator or {}).get("last")
    if scores:
        ordered = sorted(scores.items(), key=lambda kv: kv[0] != "loss")  # the loss first, as in the progress lines
        shown = ", ".join(f"{k} {v:.4f}" for k, v in ordered if isinstance(v, int | float))
        text += f"; held-out {shown} at version {_int(evaluator.get('model_version'))}"  # type: ignore[union-attr]
    return text


def _int(x: float | None) -> str:
    return "-" if x is None else str(int(x))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
