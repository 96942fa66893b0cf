"""What `rpcps local` hands its children: the job secret as a 0600 file (never its value on a
command line), and a server that leaves restarting to local."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

import cli.local
from cli.config import LocalConfig
from cli.local import Supervisor
from cli.main import ROLES
from rpcps.address import Address, EtcdAddress
from rpcps.jobsecret import JobSecret


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_children_share_a_private_secret_file_and_local_supervises_the_server(tmp_path: Path) -> None:
    local = Supervisor(LocalConfig(run_dir=str(tmp_path), workers=2))
    path = tmp_path / "job-secret"
    assert os.stat(path).st_mode & 0o777 == 0o600
    secret = path.read_text().strip()
    JobSecret.from_file(str(path))
    for child in local.children:
        assert flag(child.argv, "--job-secret-file") == str(path), child.name
        assert secret not in " ".join(child.argv)
    assert flag(local.server.argv, "--supervise") == "off"
    again = Supervisor(LocalConfig(run_dir=str(tmp_path), workers=1))  # a reused run directory keeps its secret
    assert path.read_text().strip() == secret and flag(again.server.argv, "--job-secret-file") == str(path)


def test_a_given_secret_file_is_used_as_is(tmp_path: Path) -> None:
    given = tmp_path / "mine"
    given.write_text("x" * 64)
    base = LocalConfig(run_dir=str(tmp_path / "run"))
    config = replace(base, server=replace(base.server, transport=replace(base.server.transport, job_secret_file=str(given))))
    local = Supervisor(config)
    assert all(flag(c.argv, "--job-secret-file") == str(given) for c in local.children)
    assert not (tmp_path / "run" / "job-secret").exists()


def test_without_a_checkpoint_dir_local_tells_its_children_it_said_so(tmp_path: Path) -> None:
    local = Supervisor(LocalConfig(run_dir=str(tmp_path), workers=2))
    assert all(flag(c.argv, "--checkpoints-off-ok") == "on" for c in local.children)
    base = LocalConfig(run_dir=str(tmp_path))
    kept = Supervisor(replace(base, server=replace(base.server, checkpoint=replace(base.server.checkpoint, directory=str(tmp_path / "c")))))
    assert all("--checkpoints-off-ok" not in c.argv for c in kept.children), "with checkpoints there is nothing to say"


def test_with_an_etcd_store_every_child_joins_through_it_and_no_coordinator_starts(tmp_path: Path) -> None:
    url = "etcd://127.0.0.1:2379,127.0.0.1:2380/jobs/run-1"
    base = LocalConfig(run_dir=str(tmp_path), workers=2, store=EtcdAddress.parse(url))
    local = Supervisor(replace(base, server=replace(base.server, replication=replace(base.server.replication, replicas=2))))
    assert local.coordinator is None and [c.name for c in local.servers] == ["ps", "ps_b"]
    assert all(flag(c.argv, "--store") == url for c in local.servers)
    assert all(flag(c.argv, "--ps") == url for c in local.workers)


def test_local_refuses_a_store_that_is_not_etcd() -> None:
    assert [d.path for d in ROLES["local"].settings() if d.flag == "--store"] == [("store",)], "its own, not its server's"
    with pytest.raises(ValueError, match="store must be etcd://"):
        LocalConfig(store=Address("127.0.0.1", 5000))



def test_a_server_that_does_not_serve_yet_is_not_asked_what_its_slots_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A restarted server's control plane answers before it has restored its snapshot, with no slots:
    # local's end check would take every finished slot for short and run its worker again.
    local = Supervisor(LocalConfig(run_dir=str(tmp_path), workers=2))
    asked: list[tuple] = []
    monkeypatch.setattr(cli.local.ctl, "status", lambda *args: asked.append(args) or {"slots": [{"slot": 0, "next_step": 7}]})
    local.servers[0].serving = False
    assert local._slot_progress() is None and asked == []
    local.servers[0].serving = True
    assert local._slot_progress() == {0: 7, 1: 0} and len(asked) == 1
