"""tools/check_deploy.py: the shipped deployment files agree with each other, and each kind of
disagreement a schema cannot see is reported with what to fix."""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.procs import REPO

sys.path.insert(0, str(REPO / "tools"))  # a script in the checkout, not an installed module
from check_deploy import CannotRender, check_compose, check_env_file, check_k8s, load_documents, render, without_k8s_sd

K8S = REPO / "deploy" / "k8s"
BASE_FILES = [K8S / "base" / f for f in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]]


def shipped_k8s() -> list[dict[str, Any]]:
    return load_documents([*BASE_FILES, K8S / "servicemonitor.yaml"])


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def container(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return find(docs, kind)["spec"]["template"]["spec"]["containers"][0]


def literal_worker_index(docs: list[dict[str, Any]]) -> None:
    entry = next(e for e in container(docs, "Job")["env"] if e["name"] == "RPCPS_WORKER_INDEX")
    entry.pop("valueFrom")
    entry["value"] = "0"


def test_shipped_manifests_agree() -> None:
    assert check_k8s(shipped_k8s()) == []


K8S_BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("job size", lambda d: find(d, "Job")["spec"].update(completions=4, parallelism=4),
     "RPCPS_NUM_WORKERS=2: all three must be equal"),
    ("worker index source", literal_worker_index, "must take RPCPS_WORKER_INDEX from"),
    ("server address", lambda d: container(d, "Job").update(args=["worker", "--ps=rpcps-server-0.rpcps-ps:29500"]),
     "which is not a StatefulSet pod behind its Service"),
    ("server port", lambda d: container(d, "Job").update(args=["worker", "--ps=rpcps-ps-0.rpcps-ps:29501"]),
     "port 29501 is not a port of Service rpcps-ps"),
    ("shards", lambda d: find(d, "StatefulSet")["spec"].update(replicas=2), "replicas=2 but RPCPS_SHARDS=1"),
    ("service selector", lambda d: find(d, "Service", "rpcps-worker")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "workers"}), "Service rpcps-worker selects no pods"),
    ("named target port", lambda d: find(d, "Service", "rpcps-ps")["spec"]["ports"][0].update(targetPort="grpc"),
     "targets 'grpc', which rpcps-ps does not name"),
    ("probe port", lambda d: container(d, "StatefulSet")["livenessProbe"]["grpc"].update(port=9501),
     "livenessProbe probes port 9501"),
    ("scrape annotation", lambda d: find(d, "Job")["spec"]["template"]["metadata"]["annotations"].update(
        {"prometheus.io/port": "9400"}), "prometheus.io/port 9400 is not its metrics port 9410"),
    ("token mount", lambda d: container(d, "StatefulSet")["volumeMounts"].pop(1),
     "reads its control token from /etc/rpcps/control/token, which no Secret volume is mounted over"),
    ("job secret mount", lambda d: container(d, "Job")["volumeMounts"].pop(1),
     "reads its job secret from /etc/rpcps/job/secret, which no Secret volume is mounted over"),
    ("trust", lambda d: container(d, "StatefulSet")["args"].remove("--trust-network=on"), "needs --trust-network on"),
    ("server secret", lambda d: container(d, "StatefulSet")["args"].remove("--job-secret-file=/etc/rpcps/job/secret"),
     "so rpcps needs --job-secret-file"),
    ("worker secret", lambda d: container(d, "Job")["args"].remove("--job-secret-file=/etc/rpcps/job/secret"),
     "a worker without --job-secret-file cannot register"),
    ("control token", lambda d: container(d, "StatefulSet")["args"].remove("--control-token-file=/etc/rpcps/control/token"),
     "--control-addr 0.0.0.0 is not loopback, so rpcps needs --control-token-file"),
    ("checkpoint volume", lambda d: container(d, "StatefulSet")["volumeMounts"].pop(0),
     "must keep --checkpoint-dir (/var/lib/rpcps/checkpoints) on a volumeClaimTemplate"),
    ("headless dns", lambda d: find(d, "Service", "rpcps-ps")["spec"].pop("publishNotReadyAddresses"),
     "should publish not-ready addresses"),
    ("policy ports", lambda d: find(d, "NetworkPolicy")["spec"]["ingress"][0].update(ports=[{"protocol": "TCP", "port": 29500}]),
     "must let rpcps pods reach each other on every TCP port"),
    ("policy coverage", lambda d: find(d, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "ps"}), "covers ['rpcps-ps'], not every rpcps pod"),
    ("monitor port", lambda d: find(d, "ServiceMonitor")["spec"]["endpoints"][0].update(port="http-metrics"),
     "scrapes port 'http-metrics', which Service rpcps-ps lacks"),
    ("monitor selector", lambda d: find(d, "Service", "rpcps-worker")["metadata"]["labels"].update(
        {"app.kubernetes.io/name": "other"}), "the alerts need jobs"),
    ("failure policy", lambda d: find(d, "Job")["spec"].pop("podFailurePolicy"), "has no podFailurePolicy"),
    ("thread setting", lambda d: container(d, "Job")["env"].append({"name": "OMP_NUM_THREADS", "value": "4"}),
     "sets OMP_NUM_THREADS; no recipe needs a thread setting"),
    ("two restart layers", lambda d: container(d, "StatefulSet")["args"].remove("--supervise=off"),
     "rpcps ps supervises itself (--supervise is on by default) and the kubelet restarts it too: pass --supervise off"),
]


@pytest.mark.parametrize(("what", "breakage", "message"), K8S_BREAKAGES, ids=[b[0] for b in K8S_BREAKAGES])
def test_k8s_disagreement_is_reported(what: str, breakage: Callable[[list[dict[str, Any]]], None], message: str) -> None:
    docs = copy.deepcopy(shipped_k8s())
    breakage(docs)
    problems = check_k8s(docs)
    assert any(message in p for p in problems), problems


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    return tmp_path / "deploy"


def test_shipped_compose_agrees() -> None:
    assert check_compose(REPO / "deploy" / "docker" / "compose.yaml") == []


def _edit(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("docker/compose.yaml", lambda d: d["services"]["worker1"]["environment"].update(RPCPS_WORKER_INDEX="0"),
         "worker slots [0, 0] are not 0..1"),
        ("docker/compose.yaml", lambda d: d["services"]["worker1"].update(command=["worker", "--ps=ps:29501", "--num-workers=2"]),
         "worker worker1 has --ps ps:29501, but the server is ps:29500"),
        ("docker/compose.yaml", lambda d: d["services"]["grafana"]["environment"].pop("PROMETHEUS_URL"),
         "needs PROMETHEUS_URL, which Grafana's environment lacks"),
        ("docker/compose.yaml", lambda d: d["services"]["grafana"]["volumes"].append("../grafana/missing.json:/x.json:ro"),
         "mounts ../grafana/missing.json, which does not exist"),
        ("docker/compose.yaml", lambda d: d["services"]["prometheus"]["volumes"].pop(1),
         "Prometheus loads rules /etc/prometheus/alerts.yml, which no volume provides"),
        ("docker/prometheus.yml", lambda d: d["scrape_configs"][1]["static_configs"][0].update(targets=["worker0:9410"]),
         "job rpcps-worker scrapes ['worker0:9410'], expected ['worker0:9410', 'worker1:9410']"),
        ("grafana/provisioning/dashboards/rpcps.yaml", lambda d: d["providers"][0]["options"].update(path="/dashboards"),
         "is outside every provider path ['/dashboards']"),
        ("docker/compose.yaml", lambda d: d["services"]["ps"]["command"].remove("--trust-network=on"),
         "service ps: --listen 0.0.0.0:29500 is not loopback, so rpcps needs --trust-network on"),
        ("docker/compose.yaml", lambda d: d["services"]["worker0"]["environment"].pop("RPCPS_JOB_SECRET_FILE"),
         "service worker0: a worker without --job-secret-file cannot register"),
        ("docker/compose.yaml", lambda d: d["services"]["worker1"]["environment"].update(OMP_NUM_THREADS="1"),
         "service worker1: sets OMP_NUM_THREADS; no recipe needs a thread setting"),
        ("docker/compose.yaml", lambda d: d["services"]["ps"]["command"].append("--threads=2"),
         "service ps: sets --threads; no recipe needs a thread setting"),
        ("docker/compose.yaml", lambda d: d["services"]["ps"]["command"].remove("--supervise=off"),
         "service ps: rpcps ps supervises itself (--supervise is on by default) and Docker's restart policy restarts it too"),
    ],
)
def test_compose_disagreement_is_reported(deploy_copy: Path, file: str, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    _edit(deploy_copy / file, edit)
    problems = check_compose(deploy_copy / "docker" / "compose.yaml")
    assert any(message in p for p in problems), problems


def _set_env(path: Path, key: str, value: str | None) -> None:
    """Sets (or with None removes) KEY=VALUE in an env file."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith(f"{key}=")]
    path.write_text("\n".join([*lines, *([f"{key}={value}"] if value is not None else [])]) + "\n")


def test_each_env_file_is_checked_as_compose_renders_it(deploy_copy: Path) -> None:
    """standby.env adds the coordinator and a second server: both servers join it with --replicas 2."""
    _set_env(deploy_copy / "docker" / "standby.env", "RPCPS_REPLICAS", None)
    problems = check_compose(deploy_copy / "docker" / "compose.yaml")
    assert problems and all(p.startswith("compose (--env-file standby.env): ") for p in problems), problems
    assert any("server ps-standby has --replicas 1, but 2 server service(s) run" in p for p in problems), problems


@pytest.mark.parametrize(
    ("file", "key", "value", "message"),
    [
        ("standby.env", "RPCPS_PS", None, "worker worker0 has --ps ps:29500, but the group's coordinator is store:29400"),
        ("standby.env", "RPCPS_STORE", "store:29500", "server ps has --store store:29500, but the coordinator is store:29400"),
        ("standby.env", "RPCPS_PROMETHEUS_CONFIG", "./prometheus.yml",
         "job rpcps-ps scrapes ['ps:9400'], expected ['ps-standby:9400', 'ps:9400']"),
        ("standby.env", "COMPOSE_PROFILES", "", "server ps has --replicas 2, but 1 server service(s) run"),
        ("ctr.env", "RPCPS_SPARSE_MAX_ROW", "10", "no rpcps role reads RPCPS_SPARSE_MAX_ROW"),
    ],
)
def test_env_file_disagreement_is_reported(deploy_copy: Path, file: str, key: str, value: str | None, message: str) -> None:
    path = deploy_copy / "docker" / file
    _set_env(path, key, value)
    if key == "RPCPS_SPARSE_MAX_ROW":  # a variable passed through to the server, misspelt in both places
        compose = deploy_copy / "docker" / "compose.yaml"
        compose.write_text(compose.read_text().replace("RPCPS_SPARSE_MAX_ROWS:", "RPCPS_SPARSE_MAX_ROW:"))
    problems = check_compose(deploy_copy / "docker" / "compose.yaml")
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["services"]["ps"]["command"].append("--sparse-max-row=10"), "rpcps ps has no flag --sparse-max-row"),
        (lambda d: d["services"]["worker0"]["command"].append("--replicas=2"), "rpcps worker has no flag --replicas"),
        (lambda d: d["services"]["store"]["command"].remove("--trust-network=on"),
         "service store: --listen 0.0.0.0:29400 is not loopback, so rpcps needs --trust-network on"),
        (lambda d: d["services"]["ps-standby"].update(command=[*d["services"]["ps"]["command"], "--optimizer=sgd"]),
         "not the command of ps: replicas run the same command"),
    ],
)
def test_compose_flag_and_replica_mistakes_are_reported(deploy_copy: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    _edit(deploy_copy / "docker" / "compose.yaml", edit)
    problems = check_compose(deploy_copy / "docker" / "compose.yaml")
    assert any(message in p for p in problems), problems


def standby_k8s() -> list[dict[str, Any]]:
    return [*render(K8S / "overlays" / "standby"), *load_documents([K8S / "servicemonitor.yaml"])]


@pytest.mark.parametrize("overlay", ["cpu", "ctr", "standby"])
def test_shipped_overlays_agree(overlay: str) -> None:
    assert check_k8s([*render(K8S / "overlays" / overlay), *load_documents([K8S / "servicemonitor.yaml"])]) == []


def _ps_env(docs: list[dict[str, Any]], name: str, value: str) -> None:
    next(e for e in container(docs, "StatefulSet")["env"] if e["name"] == name)["value"] = value


STANDBY_BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("store address", lambda d: _ps_env(d, "RPCPS_STORE", "rpcps-ps-0.rpcps-ps:29500"),
     "RPCPS_STORE must name the coordinator: 'rpcps-ps-0.rpcps-ps:29500' is not SERVICE:PORT of a Service"),
    ("store port", lambda d: _ps_env(d, "RPCPS_STORE", "rpcps-store:29500"), "port 29500 is not a port of Service rpcps-store"),
    ("workers join the server", lambda d: container(d, "Job")["args"].__setitem__(1, "--ps=rpcps-ps-0.rpcps-ps:29500"),
     "--ps must name the coordinator, which the servers join"),
    ("pair size", lambda d: find(d, "StatefulSet")["spec"].update(replicas=3), "replicas=3 but RPCPS_SHARDS=1 x RPCPS_REPLICAS=2"),
    ("shards", lambda d: (find(d, "StatefulSet")["spec"].update(replicas=4), _ps_env(d, "RPCPS_SHARDS", "2")),
     "RPCPS_SHARDS must be 1 and RPCPS_SHARD_INDEX"),
    ("volume per pod", lambda d: find(d, "PersistentVolumeClaim")["spec"].update(accessModes=["ReadWriteOnce"]),
     "must be one ReadWriteMany PersistentVolumeClaim they share"),
    ("same node", lambda d: find(d, "StatefulSet")["spec"]["template"]["spec"].pop("affinity"),
     "without a podAntiAffinity on kubernetes.io/hostname"),
    ("two coordinators", lambda d: find(d, "Deployment", "rpcps-store")["spec"].update(replicas=2),
     "must be a Deployment of replicas 1 with strategy Recreate"),
    ("coordinator trust", lambda d: container(d, "Deployment")["args"].remove("--trust-network=on"),
     "k8s: rpcps-store: --listen 0.0.0.0:29400 is not loopback, so rpcps needs --trust-network on"),
    ("flag typo", lambda d: container(d, "StatefulSet")["args"].append("--replica=2"), "rpcps ps has no flag --replica"),
    ("variable typo", lambda d: container(d, "StatefulSet")["env"].append({"name": "RPCPS_REPLICA", "value": "2"}),
     "no rpcps role reads RPCPS_REPLICA"),
    ("two restart layers", lambda d: container(d, "StatefulSet")["args"].remove("--supervise=off"),
     "k8s: rpcps-ps: rpcps ps supervises itself (--supervise is on by default) and the kubelet restarts it too"),
]


@pytest.mark.parametrize(("what", "breakage", "message"), STANDBY_BREAKAGES, ids=[b[0] for b in STANDBY_BREAKAGES])
def test_standby_disagreement_is_reported(what: str, breakage: Callable[[list[dict[str, Any]]], None], message: str) -> None:
    docs = standby_k8s()
    breakage(docs)
    problems = check_k8s(docs)
    assert any(message in p for p in problems), problems


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl to compare with")
@pytest.mark.parametrize("directory", ["base", "overlays/cpu", "overlays/ctr", "overlays/standby"])
def test_render_matches_kubectl_kustomize(directory: str) -> None:
    import subprocess

    def by_name(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        for d in docs:  # kustomize rewrites image names (images:); the renderer leaves them
            pod = d.get("spec", {}).get("template", {}).get("spec", {})
            for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                c["image"] = "rpcps"
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    kustomized = subprocess.run(["kubectl", "kustomize", str(K8S / directory)], capture_output=True, text=True, check=True).stdout
    assert by_name(render(K8S / directory)) == by_name(list(yaml.safe_load_all(kustomized)))


def test_render_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    standby = tmp_path / "k8s" / "overlays" / "standby" / "kustomization.yaml"
    standby.write_text(standby.read_text().replace("value: --ps=rpcps-ps-0.rpcps-ps:29500", "value: --ps=elsewhere:1"))
    with pytest.raises(CannotRender, match="patch test failed at /spec/template/spec/containers/0/args/1"):
        render(standby.parent)
    (tmp_path / "k8s" / "overlays" / "cpu" / "kustomization.yaml").write_text("resources: [../../base]\nconfigMapGenerator: []\n")
    with pytest.raises(CannotRender, match=r"cannot render \['configMapGenerator'\] without kubectl"):
        render(tmp_path / "k8s" / "overlays" / "cpu")


def test_the_launcher_env_example_names_only_settings_someone_reads(tmp_path: Path) -> None:
    example = REPO / "deploy" / "bare-metal" / "rpcps.env.example"
    assert check_env_file(example) == []
    typo = tmp_path / "rpcps.env"
    typo.write_text(example.read_text() + "#RPCPS_REPLICA=2\nRPCPS_STORE_METRICS_PORT=9391\n")
    assert check_env_file(typo) == [f"rpcps.env:{len(example.read_text().splitlines()) + 1}: neither rpcps nor its launchers read RPCPS_REPLICA"]
    pinned = tmp_path / "pinned.env"
    pinned.write_text(example.read_text() + "OMP_NUM_THREADS=4\n")
    assert [p.split(";")[0] for p in check_env_file(pinned)] == [f"pinned.env:{len(example.read_text().splitlines()) + 1}: sets OMP_NUM_THREADS"]


def test_kubernetes_discovery_is_swapped_for_an_empty_static_list() -> None:
    config = yaml.safe_load((K8S / "prometheus-k8s.yml").read_text())
    swapped = without_k8s_sd(copy.deepcopy(config))
    job = swapped["scrape_configs"][0]
    assert "kubernetes_sd_configs" not in job and job["static_configs"] == [{"targets": []}]
    assert job["relabel_configs"] == config["scrape_configs"][0]["relabel_configs"], "the rules promtool checks stay"
