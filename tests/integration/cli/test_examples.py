"""The real examples end to end at small size: trained through `rpcps local` and by hand-started roles,
scored on held-out data by the sidecar evaluator and from the exported model in plain PyTorch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import control as control_plane
from harness.procs import ENTRY, REPO, ProcessGroup, child_env, free_port, try_scrape, wait_until
from rpcps.examples import charlm
from tests.integration.conftest import read_json

pytestmark = pytest.mark.integration

DIGITS_MODEL = ["--model", "rpcps.examples.digits:model"]
"""What the server and the evaluator take (they read no training data)."""
DIGITS = [*DIGITS_MODEL, "--data", "rpcps.examples.digits:data", "--loss", "cross_entropy"]
DIGITS_EVAL = ["--eval-data", "rpcps.examples.digits:eval_batches", "--eval-fn", "rpcps.examples.digits:evaluate"]
CHARLM = ["--model", "rpcps.examples.charlm:model", "--data", "rpcps.examples.charlm:data", "--loss", "cross_entropy"]


def _digits() -> object:
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (pip install rpcps[examples])")
    from rpcps.examples import digits

    return digits


def _export(checkpoint: Path, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ENTRY), "export", "--checkpoint", str(checkpoint), "--out", str(out)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(300)
def test_digits_through_local_with_an_evaluator_and_an_exported_model(procs: ProcessGroup, tmp_path: Path) -> None:
    digits = _digits()
    summary_path, best = tmp_path / "summary.json", tmp_path / "best.pt"
    local = procs.start("local", [
        "local", "--workers", "2", "--steps", "150", *DIGITS, "--optimizer", "adam", "--lr", "0.003", *DIGITS_EVAL,
        "--every-seconds", "1", "--export-best", best, "--checkpoint-dir", tmp_path / "ckpt", "--run-dir", tmp_path / "run",
        "--summary-json", summary_path, "--progress-s", "2",
    ])
    assert local.wait(240) == 0, local.tail()
    held_out = read_json(summary_path)["evaluator"]
    # The evaluator scored the final model (it is stopped before the server, and scores once more).
    assert held_out["model_version"] == 300 and held_out["evaluations"] >= 2, held_out
    assert held_out["last"]["accuracy"] >= 0.95, held_out
    assert "held-out loss" in local.stdout()
    _export(tmp_path / "ckpt", tmp_path / "model.pt")
    model = digits.model(seed=3)  # type: ignore[attr-defined]
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert int(model.state_dict()["1.num_batches_tracked"]) > 0  # the statistics came back with the weights
    assert digits.evaluate(model) == pytest.approx(held_out["last"])  # type: ignore[attr-defined]
    kept = digits.model(seed=3)  # type: ignore[attr-defined]
    kept.load_state_dict(torch.load(best, weights_only=True))
    assert digits.evaluate(kept)["loss"] == pytest.approx(held_out["best"]["value"])  # type: ignore[attr-defined]


@pytest.mark.slow  # over 40 s on 2 cores: CI runs it in its slow pass
@pytest.mark.timeout(300)
def test_charlm_through_local_learns(procs: ProcessGroup, tmp_path: Path) -> None:
    local = procs.start("local", [
        "local", "--workers", "2", "--steps", "40", *CHARLM, "--optimizer", "adam", "--lr", "0.001",
        "--checkpoint-dir", tmp_path / "ckpt", "--run-dir", tmp_path / "run", "--progress-s", "5",
    ])
    assert local.wait(240) == 0, local.tail()
    _export(tmp_path / "ckpt", tmp_path / "model.pt")
    model = charlm.model(seed=1)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    untrained = charlm.evaluate(charlm.model(), charlm.eval_batches()[:4])
    trained = charlm.evaluate(model, charlm.eval_batches()[:4])
    assert untrained["bits_per_char"] > 7.9
    assert trained["bits_per_char"] < 6.0, trained  # 80 steps: about 5 bits per character


@pytest.mark.timeout(300)
def test_hand_started_server_worker_and_evaluator(procs: ProcessGroup, tmp_path: Path) -> None:
    digits = _digits()
    control = free_port()
    _, port, _ = procs.ps("ps", *DIGITS_MODEL, "--optimizer", "adam", "--lr", "0.003", "--control-port", str(control),
                          "--control-addr", "127.0.0.1")
    evaluator_metrics = free_port()
    evaluator = procs.start("evaluator", [
        "evaluate", "--ps", f"127.0.0.1:{port}", *DIGITS_MODEL, *DIGITS_EVAL, "--every-seconds", "0.5",
        "--export-best", tmp_path / "best.pt", "--metrics-port", evaluator_metrics, "--metrics-addr", "127.0.0.1",
        "--summary-json", tmp_path / "evaluator.json",
    ])
    # Held until the evaluator has scored once: an evaluator scores only a changed model, and one
    # slower to start (a loaded machine) than the worker's 200 steps would see the final model only.
    control_plane.pause(f"127.0.0.1:{control}", 90, wait_for_ready=True)
    worker, _ = procs.worker("worker0", port, 0, 1, *DIGITS, "--steps", "200")
    scored = "rpcps_evaluator_evaluations_total"
    wait_until(lambda: try_scrape(evaluator_metrics).get(scored, 0) >= 1 or not evaluator.alive(), 90, "the evaluator's first score")
    assert evaluator.alive(), evaluator.tail()
    control_plane.resume(f"127.0.0.1:{control}")
    assert worker.wait(200) == 0, worker.tail()

    def final_scored() -> dict[str, float] | None:
        assert evaluator.alive(), evaluator.tail()
        m = try_scrape(evaluator_metrics)
        return m if m.get("rpcps_evaluator_model_version") == 200 else None

    metrics = wait_until(final_scored, 60, "the evaluator to score the final model version")
    assert metrics['rpcps_evaluator_metric{name="accuracy"}'] >= 0.95, metrics
    assert metrics["rpcps_evaluator_best_model_version"] <= 200 and metrics["rpcps_evaluator_evaluations_total"] >= 2
    live = tmp_path / "live.pt"
    ctl = subprocess.run(
        [sys.executable, str(ENTRY), "ctl", "export", "--addr", f"127.0.0.1:{control}", "--out", str(live)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )
    assert ctl.returncode == 0 and "model of version 200" in ctl.stdout, ctl.stderr
    model = digits.model()  # type: ignore[attr-defined]
    model.load_state_dict(torch.load(live, weights_only=True))
    assert digits.evaluate(model)["accuracy"] == pytest.approx(metrics['rpcps_evaluator_metric{name="accuracy"}'])  # type: ignore[attr-defined]
    evaluator.send(15)
    assert evaluator.wait(60) == 0, evaluator.tail()
    assert read_json(tmp_path / "evaluator.json")["model_version"] == 200
    assert "malloc_trim: every 3s" in evaluator.stderr(), "the evaluator (a model copy per pull) gives free heap back too"


@pytest.mark.timeout(120)
def test_an_evaluator_with_another_model_is_refused(procs: ProcessGroup) -> None:
    _digits()
    _, port, _ = procs.ps("ps", *DIGITS_MODEL)
    evaluator = procs.start("evaluator", [
        "evaluate", "--ps", f"127.0.0.1:{port}", "--eval-data", "rpcps.examples.digits:eval_batches", "--metrics-port", "0",
        "--metrics-addr", "127.0.0.1",
    ])
    assert evaluator.wait(90) == 5, evaluator.tail()
    assert "the evaluator's model differs from the server's" in evaluator.stderr()
