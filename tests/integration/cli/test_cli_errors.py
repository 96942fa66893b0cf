"""Bad settings and an unreachable server: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import REPO, ProcessGroup, child_env, dies_with_us, free_port

pytestmark = pytest.mark.integration


def _assert_one_clear_error(stderr: str, role: str, message: str) -> None:
    errors = [line for line in stderr.splitlines() if re.match(rf"rpcps {role}: error: ", line)]
    assert len(errors) == 1, stderr
    assert message in errors[0], stderr
    for noise in ("Traceback", "frame #", "Exception raised from"):
        assert noise not in stderr, f"stderr holds {noise!r}:\n{stderr}"


BAD_SETTINGS = [
    (["worker", "--ps", "127.0.0.1:1", "--steps", "-1"], 2, "--steps must be >= 1, got -1"),
    (["ps", "--optimizer", "nope"], 2, "argument --optimizer: 'nope' is not one of ['adagrad', 'adam'"),
    (["ps", "--metrics-port", "0", "--optimizer", "sgd", "--optimizer-args", '{"momentom": 0.9}'], 2,
     "optimizer 'sgd' has no setting 'momentom'; it accepts ['lr', 'momentum'"),
    (["ps", "--metrics-port", "0", "--model", "no_such_module:model"], 2,
     "--model 'no_such_module:model': cannot import 'no_such_module'"),
    (["worker", "--ps", "127.0.0.1:1", "--worker-index", "2", "--num-workers", "2"], 2,
     "--worker-index must be in [0, 2) for 2 workers, got 2"),
    (["local", "--steps", "0"], 2, "--steps must be >= 1, got 0"),
    (["local", "--worker", "2"], 2, "unrecognized arguments: --worker 2; did you mean --workers? (see `rpcps local --help`)"),
    (["worker", "--ps", "127.0.0.1:1", "--stesp", "5"], 2,
     "unrecognized arguments: --stesp 5; did you mean --steps? (see `rpcps worker --help`)"),
    (["local", "--model", "rpcps.tasks:nope"], 2, "--model 'rpcps.tasks:nope': module 'rpcps.tasks' has no attribute 'nope'"),
    (["local", "--model", "rpcps.plugins:BUILTIN_MODEL"], 2, "--model 'rpcps.plugins:BUILTIN_MODEL' is not callable (it is a str)"),
    (["ps", "--metrics-port", "0", "--model", "torch.nn:Linear"], 2,
     "--model 'torch.nn:Linear' could not be called with no arguments"),
    (["local", "--data", "rpcps.tasks:nope"], 2, "--data 'rpcps.tasks:nope': module 'rpcps.tasks' has no attribute 'nope'"),
    (["local", "--data", "rpcps.plugins:BUILTIN_DATA"], 2, "--data 'rpcps.plugins:BUILTIN_DATA' is not callable (it is a str)"),
    (["local", "--loss", "no_such_module:loss"], 2, "--loss 'no_such_module:loss': cannot import 'no_such_module'"),
    (["local", "--loss", "rpcps.plugins:BUILTIN_MODEL"], 2, "--loss 'rpcps.plugins:BUILTIN_MODEL' is not callable (it is a str)"),
]
BAD_SETTINGS_IDS = [
    "negative-steps", "unknown-optimizer", "unknown-optimizer-setting", "unimportable-model", "worker-index", "zero-steps",
    "flag-prefix", "flag-typo", "model-not-found", "model-not-callable", "model-not-a-factory", "data-not-found",
    "data-not-callable", "loss-not-found", "loss-not-callable",
]


@pytest.fixture(scope="module")
def bad_settings_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], tuple[int, str]]:
    """argv -> (exit code, stderr) of every command line in BAD_SETTINGS, each run in a process of its
    own, forked after one shared import of torch (cli_batch.py); the other tests here start
    ``trainer_entry.py`` itself."""
    out = tmp_path_factory.mktemp("cli_batch")
    argvs = [argv for argv, _, _ in BAD_SETTINGS]
    done = subprocess.run(
        dies_with_us([sys.executable, str(Path(__file__).with_name("cli_batch.py")), str(out)]),
        input=json.dumps(argvs), cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    codes = json.loads(done.stdout.splitlines()[-1])
    return {tuple(argv): (code, (out / f"{n}.err").read_text(errors="replace")) for n, (argv, code) in enumerate(zip(argvs, codes, strict=True))}


@pytest.mark.parametrize(("argv", "code", "message"), BAD_SETTINGS, ids=BAD_SETTINGS_IDS)
@pytest.mark.timeout(240)  # the first test of a pytest worker starts the batch of all of them
def test_bad_settings_fail_with_one_line(bad_settings_runs: dict[tuple[str, ...], tuple[int, str]], argv: list[str], code: int,
                                        message: str) -> None:
    exit_code, stderr = bad_settings_runs[tuple(argv)]
    assert exit_code == code, stderr
    _assert_one_clear_error(stderr, argv[0], message)


@pytest.mark.timeout(60)
def test_a_checkpoint_dir_that_is_a_file_is_refused_by_name(procs: ProcessGroup, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    proc = procs.start("cli", ["local", "--steps", "5", "--checkpoint-dir", path])
    assert proc.wait(45) == 2
    _assert_one_clear_error(proc.stderr(), "local", f"--checkpoint-dir {path} is a file, not a directory")
    assert proc.stdout() == "", "nothing may start"


@pytest.mark.timeout(60)
def test_unreachable_server_fails_with_one_line(procs: ProcessGroup) -> None:
    port = free_port()  # nothing listens there
    worker, _ = procs.worker("worker0", port, 0, 1, "--connect-timeout-s", "2")
    assert worker.wait(45) == 1
    _assert_one_clear_error(worker.stderr(), "worker", f"no parameter server answered at 127.0.0.1:{port} within 2s")


@pytest.mark.timeout(60)
def test_a_worker_waiting_for_its_server_says_so_at_once_and_every_few_seconds(procs: ProcessGroup) -> None:
    port = free_port()  # nothing listens there
    worker, _ = procs.worker("worker0", port, 0, 1, "--connect-timeout-s", "6")
    assert worker.wait(45) == 1
    lines = worker.stderr().splitlines()
    waits = [i for i, line in enumerate(lines) if f"waiting for the parameter server at 127.0.0.1:{port}" in line]
    assert waits and waits[0] < 5, f"the first lines must say what the worker waits for:\n{worker.stderr()}"
    assert any(f"still waiting for the parameter server at 127.0.0.1:{port}: 5s of 6s" in line for line in lines), worker.stderr()
    _assert_one_clear_error(worker.stderr(), "worker", f"no parameter server answered at 127.0.0.1:{port} within 6s")


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.timeout(60)
def test_server_on_a_port_in_use_says_so(procs: ProcessGroup, busy_port: int) -> None:
    ps, _, _ = procs.ps(port=busy_port)
    assert ps.wait(45) == 1
    _assert_one_clear_error(ps.stderr(), "ps", f"port {busy_port} on 127.0.0.1 is already in use")


@pytest.mark.timeout(60)
def test_metrics_port_in_use_says_so(procs: ProcessGroup, busy_port: int) -> None:
    """Started as people start it: under its own supervisor, which does not retry a failed start."""
    ps = procs.start("ps", ["ps", "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(busy_port)])
    assert ps.wait(45) == 1
    _assert_one_clear_error(ps.stderr(), "ps", f"cannot serve metrics on 127.0.0.1:{busy_port}: Address already in use")
    assert "not restarting it: a restart cannot fix that" in ps.stderr()
