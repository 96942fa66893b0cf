"""The fork server (rpcps/prefork.py): its children run a script as a fresh interpreter would, with
their own streams, argv, environment, session and exit code, and die with it when asked to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import pid_alive, wait_until
from rpcps.prefork import ForkServer

pytestmark = pytest.mark.timeout(120)

REPORT = textwrap.dedent(
    """
    import json, os, sys, tempfile
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0], "path": sys.path,
        "secret": os.environ.get("RPCPS_SOMETHING"), "log_level": os.environ.get("TORCH_CPP_LOG_LEVEL"),
        "tmp": tempfile.gettempdir(), "preloaded": "torch" in sys.modules, "ours": "rpcps.options" in sys.modules,
        "session": os.getsid(0) == os.getpid(), "title": open("/proc/self/cmdline", "rb").read().decode(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)
SLEEPER = "import sys, time\nprint('up', flush=True)\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    cwd = tmp_path_factory.mktemp("cwd")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCPS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    forks = ForkServer(env, cwd, preload_env={"TORCH_CPP_LOG_LEVEL": "ERROR"}, pdeathsig=signal.SIGTERM)
    yield forks
    forks.close()


def _run(forks: ForkServer, script: Path, args: list[str], env: dict[str, str], out: Path, err: Path):
    with open(os.devnull, "rb") as devnull, open(out, "wb") as o, open(err, "wb") as e:
        return forks.spawn(script, args, env, stdin=devnull.fileno(), stdout=o.fileno(), stderr=e.fileno())


def test_a_child_runs_its_script_as_main_with_its_own_argv_environment_streams_and_exit_code(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    extra = tmp_path / "plugins"
    env = dict(server.env, RPCPS_SOMETHING="mine", TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(extra), server.env["PYTHONPATH"]]))
    child = _run(server, script, ["3", "--flag"], env, tmp_path / "out", tmp_path / "err")
    assert child.wait(60) == 3
    seen = json.loads((tmp_path / "out").read_text())
    assert seen["argv"] == [str(script), "3", "--flag"]
    assert seen["orig_argv"][1:] == [str(script), "3", "--flag"]  # what a process that re-execs itself runs again
    assert seen["name"] == "__main__"
    assert seen["cwd"] == server.cwd
    assert seen["path0"] == str(script.parent)
    assert seen["path"][1] == str(extra)  # the child's own PYTHONPATH, in its order
    assert seen["secret"] == "mine"
    assert seen["log_level"] is None  # restored to the request's: the script sets its own default
    assert seen["tmp"] == str(tmp_path)
    assert seen["preloaded"] and not seen["ours"]
    assert seen["session"]
    assert seen["title"].rstrip("\0").split(" ")[1:] == [str(script), "3", "--flag"]  # ps shows what it runs
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_a_signal_ends_a_child_and_wait_times_out_while_it_runs(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    child = _run(server, script, [], dict(server.env), tmp_path / "out", tmp_path / "err")
    wait_until(lambda: (tmp_path / "out").read_text() == "up\n", 60, "the sleeper to start")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    assert not pid_alive(child.pid)  # waited for by the server, not left a zombie


def test_a_child_whose_environment_the_preloaded_libraries_read_is_refused(server: ForkServer, tmp_path: Path) -> None:
    assert server.can_run(dict(server.env, RPCPS_ANYTHING="1", PYTEST_CURRENT_TEST="x"), server.cwd)
    assert server.can_run(dict(server.env, TORCH_CPP_LOG_LEVEL="ERROR"), server.cwd)
    assert not server.can_run(dict(server.env, TORCH_CPP_LOG_LEVEL="INFO"), server.cwd)
    assert not server.can_run(dict(server.env, OMP_NUM_THREADS="7"), server.cwd)
    assert not server.can_run({k: v for k, v in server.env.items() if k != "PATH"}, server.cwd)
    assert not server.can_run(dict(server.env), tmp_path)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS.*start it as a subprocess"):
        _run(server, tmp_path / "x.py", [], dict(server.env, OMP_NUM_THREADS="7"), tmp_path / "out", tmp_path / "err")


def test_children_die_with_the_server_and_report_an_unknown_status(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    forks = ForkServer(env, tmp_path, pdeathsig=signal.SIGTERM)
    try:
        child = _run(forks, script, [], env, tmp_path / "out", tmp_path / "err")
        wait_until(lambda: (tmp_path / "out").read_text() == "up\n", 60, "the sleeper to start")
        forks.process.kill()
        assert child.wait(30) == 255
        wait_until(lambda: not pid_alive(child.pid), 30, "the child to die with its server")
    finally:
        forks.close()
    with pytest.raises(OSError):
        _run(forks, script, [], env, tmp_path / "out", tmp_path / "err")


def test_the_server_ends_when_its_starter_closes_it(tmp_path: Path) -> None:
    forks = ForkServer(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3])), tmp_path)
    forks.close()
    assert forks.process.returncode == 0
