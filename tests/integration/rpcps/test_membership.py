"""Pins the private torch RPC membership handling in ``rpcps.transport.membership`` and ``ps.lifecycle.reaper``.

In a dynamic torch RPC group every join calls every listed member, so one listed process that is
gone makes every later join fail. These tests check the ways a member leaves the list: a worker
that ends asks the server to drop it before it exits, and the reaper drops a killed one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.procs import ProcessGroup, try_scrape, wait_until
from tests.integration.conftest import wait_for_updates

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_finished_worker_is_out_of_the_group_before_it_exits(procs: ProcessGroup) -> None:
    ps, port, _ = procs.ps()
    first, _ = procs.worker("first", port, 0, 2, "--steps", "5")
    assert first.wait(60) == 0, first.tail()
    name = re.search(r"registered as (worker0_r\d+)", ps.stderr())
    assert name, ps.stderr()
    # Written by the server while it handled the worker's request, i.e. before the worker exited.
    assert f"removed {name.group(1)} from the RPC group" in ps.stderr()
    second, _ = procs.worker("second", port, 1, 2, "--steps", "5")
    assert second.wait(60) == 0, second.tail()


@pytest.mark.timeout(150)
def test_a_killed_worker_is_reaped_and_later_joins_succeed(procs: ProcessGroup) -> None:
    ps, port, ps_metrics = procs.ps("ps", "--lease-s", "1")
    victim, _ = procs.worker("victim", port, 0, 2, "--steps", "1000000")
    wait_for_updates(ps_metrics, 10, proc=ps)
    victim.kill()
    wait_until(
        lambda: try_scrape(ps_metrics).get("rpcps_server_workers_reaped_total", 0) >= 1,
        timeout=30, what="the server to reap the killed worker",
    )
    assert try_scrape(ps_metrics)["rpcps_server_live_workers"] == 0
    newcomer, _ = procs.worker("newcomer", port, 1, 2, "--steps", "5")
    assert newcomer.wait(60) == 0, newcomer.tail()


@pytest.mark.timeout(240)
def test_a_join_that_failed_on_a_dead_member_is_cleaned_up(procs: ProcessGroup, tmp_path: Path) -> None:
    """A worker joining while a killed one is still listed fails; both are then removed.

    Timing-dependent by nature: if the joiner starts too late, the reaper has already removed the
    dead member and the join simply succeeds; the invariant checked either way is that a later
    join succeeds.
    """
    fast = ["--rpc-timeout-s", "5"]
    ps, port, ps_metrics = procs.ps("ps", "--lease-s", "8", *fast)
    victim, _ = procs.worker("victim", port, 0, 3, "--steps", "1000000", *fast)
    wait_for_updates(ps_metrics, 10, proc=ps)
    victim.kill()
    joiner, _ = procs.worker("joiner", port, 1, 3, "--steps", "5", *fast)
    code = joiner.wait(90)
    if code != 0:
        assert "could not join the server" in joiner.stderr(), joiner.tail()
        wait_until(lambda: "whose join failed, from the RPC group" in ps.stderr(), timeout=60,
                   what="the server to drop the failed join")
    wait_until(lambda: try_scrape(ps_metrics).get("rpcps_server_workers_reaped_total", 0) >= 1 + (code != 0),
               timeout=60, what="the server to reap the dead members")
    last, _ = procs.worker("last", port, 2, 3, "--steps", "5", *fast)
    assert last.wait(60) == 0, last.tail()
