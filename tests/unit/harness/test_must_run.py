"""The must-run list (tests/must_run.py, the hook in tests/conftest.py): a listed test that skips fails
the run; an unlisted one may skip; a list naming tests that do not exist is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.procs import REPO
from tests.must_run import MustRunList
from tests.pytest_run import run_pytest

# A skip in each place a test can skip: pytest.skip in the body, a skipif marker, a fixture.
TINY = textwrap.dedent(
    """
    import pytest

    @pytest.fixture
    def tool():
        pytest.skip("no tool in a fixture")

    def test_body_skip():
        pytest.skip("no tool in the body")

    @pytest.mark.skipif(True, reason="no tool per marker")
    def test_marker_skip():
        pass

    def test_fixture_skip(tool):
        pass

    @pytest.mark.parametrize("part", ["a", "b"])
    def test_param_skip(part):
        pytest.skip(f"no tool for {part}")

    def test_unlisted_skip():
        pytest.skip("may skip")

    def test_runs():
        pass
    """
)


def must_run(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "must_run.txt"
    path.write_text("# a comment\n\n" + "".join(f"{line}  # why\n" for line in lines))
    return str(path)


@pytest.mark.timeout(120)
def test_a_listed_test_that_skips_fails_and_says_why(tmp_path: Path) -> None:
    listed = must_run(tmp_path, "test_tiny.py::test_body_skip", "test_tiny.py::test_marker_skip",
                      "test_tiny.py::test_fixture_skip", "test_tiny.py::test_param_skip[b]")
    run = run_pytest(tmp_path, TINY, "--must-run", listed)
    out = run.stdout
    assert run.returncode == 1, out
    assert "2 failed, 1 passed, 2 skipped, 2 errors" in out, out  # fixture and marker skips happen at setup
    for name, reason in (("test_body_skip", "no tool in the body"), ("test_marker_skip", "no tool per marker"),
                         ("test_fixture_skip", "no tool in a fixture"), ("test_param_skip[b]", "no tool for b")):
        assert f"test_tiny.py::{name} must run here ({listed} lists it) but skipped: " in out, out
        assert reason in out
    assert "SKIPPED [1] test_tiny.py:20: no tool for a" in out and "may skip" in out


@pytest.mark.timeout(120)
def test_without_the_option_skips_stay_skips(tmp_path: Path) -> None:
    run = run_pytest(tmp_path, TINY)
    assert run.returncode == 0 and "1 passed, 6 skipped" in run.stdout, run.stdout


@pytest.mark.timeout(120)
def test_a_list_naming_a_test_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    listed = must_run(tmp_path, "test_tiny.py::test_renamed", "test_gone.py")
    run = run_pytest(tmp_path, TINY, "--must-run", listed)
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "lists tests that do not exist (renamed or removed?): ['test_tiny.py::test_renamed', 'test_gone.py']" in run.stderr


def test_lines_name_a_node_and_everything_below_it(tmp_path: Path) -> None:
    listed = MustRunList.read(Path(must_run(tmp_path, "a.py::test_x", "b.py", "c.py::test_y[1]")))
    assert listed.node_ids == ("a.py::test_x", "b.py", "c.py::test_y[1]")
    assert listed.covers("a.py::test_x") and listed.covers("a.py::test_x[p]") and listed.covers("b.py::K::test_z")
    assert not listed.covers("a.py::test_xy") and not listed.covers("c.py::test_y[2]") and not listed.covers("bb.py::t")
    # Only lines whose file was collected (or is gone) can be stale: a run of a subset is no error.
    (tmp_path / "b.py").write_text("")
    assert listed.stale(["a.py::test_x"], tmp_path) == ["c.py::test_y[1]"]


def test_the_shipped_list_names_only_existing_tests() -> None:
    listed = MustRunList.read(REPO / "tests" / "must_run.txt")
    missing = [line for line in listed.node_ids if not (REPO / line.split("::", 1)[0]).exists()]
    assert listed.node_ids and missing == []
