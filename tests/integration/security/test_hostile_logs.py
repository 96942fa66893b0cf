"""A peer that puts newlines and fake log lines in what it sends cannot forge a line of the
server's log (issue 24, parts 4 and 6; docs/SECURITY.md, "Logs that cannot be forged"), and a
registration under a name that is no member does not break the reaper (part 5).

``log_forger.py`` joins a real server's group with plain torch and sends ``x\\nERROR ps: forged ...``
as a registration's name and slot, a name to drop, a standby's name, a log append's sender and
epoch, and (holding the job secret) the name of a registration the server accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.procs import REPO, ProcessGroup, scrape_metrics, try_scrape, wait_until
from rpcps.secret_files import create_secret_file
from tests.integration.conftest import wait_for_updates

pytestmark = pytest.mark.integration

FORGED = "ERROR ps: forged"
ESCAPED = "x\\nERROR ps: forged"


@pytest.mark.timeout(240)
def test_forged_log_lines_stay_escaped_on_one_line_and_training_goes_on(procs: ProcessGroup, tmp_path: Path) -> None:
    job_secret = tmp_path / "job-secret"
    create_secret_file(job_secret)
    ps, port, ps_metrics = procs.ps("ps", "--job-secret-file", str(job_secret))
    worker, _ = procs.worker("worker", port, 0, 1, "--steps", "1000000", "--job-secret-file", str(job_secret))
    wait_for_updates(ps_metrics, 10, proc=ps)
    forger = procs.start("forger", [f"127.0.0.1:{port}", str(job_secret)], script=REPO / "tests/integration/security/log_forger.py")
    assert forger.wait(120) == 0, forger.tail()
    results = json.loads(forger.stdout().strip().splitlines()[-1])
    for refused in ("name", "slot"):
        assert "RegistrationRefused" in results[refused], results
    assert results["leave"] == "'refused'", results
    assert "ReplicaRefused" in results["attach"] and results["append"].startswith("Fenced("), results
    assert results["ghost"].startswith("Registration("), results  # accepted: it holds the secret

    # The reaper finds the ghost's name unknown to the agent and marks its slot dead at once.
    wait_until(lambda: try_scrape(ps_metrics).get('rpcps_server_reaper_ping_failures_total{kind="unknown"}', 0) >= 1, 30,
               "the reaper to ping the ghost")
    wait_until(lambda: f"{ESCAPED} member (slot 1) is gone" in ps.stderr(), 30, "the reaper to log the ghost gone")
    log = ps.stderr()
    for line in (
        f"refused registration of worker slot 0 by '{ESCAPED} name'",
        f"refused registration of worker slot 0\\n{FORGED} slot by 'forger'",
        f"refused a request to drop '{ESCAPED} leave'",
        f"refused replication call (attach by '{ESCAPED} attach')",
        f"{ESCAPED} sender (epoch 9\\n{FORGED} epoch) sent log entries",
        f"worker slot 1 registered as {ESCAPED} member",
    ):
        assert line in log, line
    lines = log.splitlines()
    assert not [line for line in lines if line.lstrip().startswith(FORGED)], "a forged line reached the log"
    assert log.count(FORGED) == log.count(f"\\n{FORGED}") >= 7, "every forged value is escaped where it is logged"
    assert "membership-reaper failed" not in log and "Logging error" not in log

    metrics = scrape_metrics(ps_metrics)
    assert metrics['rpcps_server_registrations_refused_total{reason="no_proof"}'] == 1
    assert metrics['rpcps_server_registrations_refused_total{reason="unknown_challenge"}'] == 1
    assert metrics['rpcps_replica_refused_total{reason="no_proof"}'] == 1
    assert metrics['rpcps_server_reaper_ping_failures_total{kind="unknown"}'] == 1, "once: its slot is dead from then on"
    # Training goes on, with the one real worker live.
    wait_for_updates(ps_metrics, int(metrics["rpcps_server_updates_applied_total"]) + 20, proc=ps)
    assert worker.alive() and "lost the server" not in worker.stderr(), worker.tail()
    assert scrape_metrics(ps_metrics)["rpcps_server_live_workers"] == 1
