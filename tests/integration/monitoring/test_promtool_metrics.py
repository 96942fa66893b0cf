"""``promtool check metrics`` is clean on every live /metrics endpoint of a short local run.

The endpoints are read after every series has data (histograms observed, counters moved), so
the lint sees what a real scrape sees, not a freshly started registry.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rpcps.scrape import metrics_text

try:
    from monitoring_support import LocalRun, wait_for
except ImportError:  # tests/ laid out as a package
    from .monitoring_support import LocalRun, wait_for

PROMTOOL = shutil.which("promtool")
STEPS = 20000  # far more than needed; the fixture stops the run once the endpoints are checked

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian: apt-get install prometheus)"),
]


def lint(text: str) -> tuple[int, str]:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False)
    return result.returncode, (result.stdout + result.stderr).strip()


def scrape(address: str) -> str:
    host, _, port = address.rpartition(":")
    return metrics_text(int(port), host, timeout=5)


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """child name -> the text of its /metrics, once the run has trained for a while. The run stops
    once they are read: kept to the module's end, it trained on beside whatever other tests its
    xdist worker ran meanwhile (44 CPU-s, the most of any test directory)."""
    with LocalRun(tmp_path_factory.mktemp("promtool") / "run", workers=2, steps=STEPS) as run:
        addresses = run.endpoints()

        def texts() -> dict[str, str]:
            try:
                return {child: scrape(address) for child, address in addresses.items()}
            except OSError:
                return {}

        def busy(t: dict[str, str]) -> bool:
            if set(t) != {"ps", "worker0", "worker1"}:
                return False
            pushes = [samples(t[w]).get("rpcps_worker_push_latency_seconds_count", 0) for w in ("worker0", "worker1")]
            return samples(t["ps"]).get("rpcps_server_updates_applied_total", 0) > 0 and min(pushes) > 0

        read = wait_for(texts, busy, 60, "the server and both workers to serve metrics with updates applied",
                        run.diagnostics)
    yield read


@pytest.mark.parametrize("child", ["ps", "worker0", "worker1"])
def test_endpoint_passes_promtool_check_metrics(endpoints: dict[str, str], child: str) -> None:
    code, output = lint(endpoints[child])
    assert (code, output) == (0, ""), f"promtool check metrics on {child}'s /metrics:\n{output}"


def test_promtool_check_metrics_flags_a_misnamed_counter() -> None:
    """The check above can fail: promtool does object to a counter without _total."""
    code, output = lint("# HELP rpcps_things Things.\n# TYPE rpcps_things counter\nrpcps_things 1\n")
    assert code != 0 and "_total" in output
