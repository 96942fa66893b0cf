#!/usr/bin/env python3
"""Cross-checks the deployment files against each other, where schemas cannot see mistakes.

A schema says a Service is well formed; it does not say that its selector matches the pods, that
the port it names exists in them, that the Job runs as many pods as the workers are told there are
slots, that a standby joins the coordinator its workers join, or that Prometheus scrapes the ports
the processes serve on. This does, for deploy/docker/compose.yaml (+ its prometheus configs and the
Grafana provisioning; once with its defaults and once with each *.env file beside it, as
`docker compose --env-file` renders it) and the Kubernetes manifests (rendered by kustomize, or the
base files). Run by deploy/validate.sh:

    .venv/bin/python tools/check_deploy.py compose deploy/docker/compose.yaml
    .venv/bin/python tools/check_deploy.py k8s RENDERED.yaml [deploy/k8s/servicemonitor.yaml ...]
    .venv/bin/python tools/check_deploy.py k8s --each A.yaml B.yaml ... --with deploy/k8s/servicemonitor.yaml
    .venv/bin/python tools/check_deploy.py render deploy/k8s/overlays/standby > RENDERED.yaml   # without kubectl
    .venv/bin/python tools/check_deploy.py env-file deploy/bare-metal/rpcps.env.example
    .venv/bin/python tools/check_deploy.py prometheus-without-k8s-sd IN.yml OUT.yml

Exit status 0 when nothing is wrong, 1 with one line per problem on stderr, 2 on bad usage.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

REPO = Path(__file__).resolve().parent.parent
SERVER_METRICS_DEFAULT = 9400
WORKER_METRICS_DEFAULT = 9410
STORE_METRICS_DEFAULT = 9390
RPC_PORT_DEFAULT = 29500
JOBS = {"ps": "rpcps-ps", "worker": "rpcps-worker"}  # what deploy/prometheus/alerts.yml selects
STORE_JOB = "rpcps-store"  # the coordinator's job, where one runs (alert RpcpsCoordinatorDown)
ROLES = ("ps", "worker", "store")
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


# ---------------------------------------------------------------- helpers


def flag(args: Iterable[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` in a command line, or None."""
    items = [str(a) for a in args]
    for i, item in enumerate(items):
        if item.startswith(f"{name}="):
            return item.split("=", 1)[1]
        if item == name and i + 1 < len(items):
            return items[i + 1]
    return None


def env_list(container: dict[str, Any]) -> dict[str, Any]:
    """A Kubernetes container's env as {name: value or valueFrom}."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def env_map(service: dict[str, Any], outer: dict[str, str] | None = None) -> dict[str, str]:
    """A Compose service's environment (mapping or KEY=VALUE list) as a dict.

    A variable listed without a value takes the value of ``outer`` (what `docker compose` runs
    with: its environment and --env-file), or is left out, as Compose does.
    """
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    outer = outer or {}
    return {k: str(v) if v is not None else outer[k] for k, v in env.items() if v is not None or k in outer}


def setting(args: Iterable[str], env: dict[str, Any], flag_name: str, default: str | None = None) -> str | None:
    """An rpcps setting as the process resolves it: flag, then RPCPS_<NAME>, then the default."""
    value = flag(args, flag_name)
    if value is None:
        value = env.get("RPCPS_" + flag_name.lstrip("-").replace("-", "_").upper())
    return default if value is None else str(value)


@functools.cache
def cli_settings() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """{role: (its flags, its RPCPS_* variables)}, from the command line's own declarations (cli/main.py)."""
    sys.path.insert(0, str(REPO))  # tools/ runs from a checkout, not an installed package
    try:
        from cli.main import ROLES as CLI_ROLES
    except ImportError as e:
        raise SystemExit(f"check_deploy: cannot import rpcps's command line ({e}): run it from the checkout, with the "
                         "project's Python (PYTHON=.venv/bin/python), to check the flags the recipes pass") from None

    found = {}
    for role in (*ROLES, "evaluate"):
        settings = CLI_ROLES[role].settings()
        found[role] = (frozenset(d.flag for d in settings), frozenset(d.env for d in settings))
    return found


def unknown_settings(where: str, role: str, args: Iterable[str], env: Iterable[str]) -> list[str]:
    """Flags that `rpcps ROLE` does not have, and RPCPS_* variables no rpcps role reads: either is a typo
    that rpcps would refuse (a flag) or silently ignore (a variable)."""
    flags, _ = cli_settings()[role]
    variables = frozenset().union(*(names for _, names in cli_settings().values()))
    problems = [f"{where}: rpcps {role} has no flag {name} (see `rpcps {role} --help`)"
                for name in (str(a).split("=", 1)[0] for a in args) if name.startswith("--") and name not in flags]
    problems += [f"{where}: no rpcps role reads {name} (a typo? `rpcps ps --help` lists each flag's variable)"
                 for name in env if name.startswith("RPCPS_") and name not in variables]
    return problems


THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RPCPS_THREADS", "--threads")
"""What pins a process's intra-op threads. No recipe needs one: every process shares its host's usable
cores (affinity, cgroup quota) with the other rpcps processes there and follows them (rpcps.threads);
a pinned count stays wrong when the processes or the limits around it change."""


def thread_settings(where: str, args: Iterable[str], env: Iterable[str]) -> list[str]:
    """A thread setting in a recipe's arguments or environment (see ``THREAD_SETTINGS``)."""
    named = [str(a).split("=", 1)[0] for a in args] + list(env)
    return [f"{where}: sets {name}; no recipe needs a thread setting (the host budget of rpcps.threads chooses, "
            "and one set here pins the threads for good)" for name in named if name in THREAD_SETTINGS]


def restart_layers(where: str, role: str, args: Iterable[str], env: dict[str, Any], restarter: str) -> list[str]:
    """A server that restarts itself under a platform that restarts it too: one layer restarts it in
    every recipe (docs/DEPLOY.md, "Who restarts what"); two stack their backoffs and give-up rules."""
    if role != "ps" or setting(args, env, "--supervise", "on") in ("off", "false", "no", "0"):
        return []
    return [(f"{where}: rpcps ps supervises itself (--supervise is on by default) and {restarter} restarts it too: "
             "pass --supervise off (one layer of restarts per recipe, docs/DEPLOY.md \"Who restarts what\")")]


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def exposure_problems(where: str, role: str, args: list[str], env: dict[str, Any]) -> list[str]:
    """What rpcps itself would refuse at start (ps/lifecycle/exposure.py), caught before anyone deploys it.

    The server's RPC ports off loopback need --trust-network on and a job secret; every worker of
    such a server needs the secret too (it cannot register without it); a control plane off
    loopback needs a token.
    """
    problems = []
    if role in ("ps", "store"):  # the coordinator's --listen is a torch RPC port like the server's
        listen = setting(args, env, "--listen", "127.0.0.1:29500") or ""
        if not _loopback(listen.rsplit(":", 1)[0]):
            if setting(args, env, "--trust-network", "off") not in ("on", "true", "yes", "1"):
                problems.append(f"{where}: --listen {listen} is not loopback, so rpcps needs --trust-network on (docs/SECURITY.md)")
            if setting(args, env, "--job-secret-file") is None:
                problems.append(f"{where}: --listen {listen} is not loopback, so rpcps needs --job-secret-file")
    if role == "ps":
        control = setting(args, env, "--control-addr", "127.0.0.1") or ""
        if not _loopback(control) and setting(args, env, "--control-token-file") is None:
            problems.append(f"{where}: --control-addr {control} is not loopback, so rpcps needs --control-token-file")
    elif role == "worker" and setting(args, env, "--job-secret-file") is None:
        problems.append(f"{where}: a worker without --job-secret-file cannot register with a server off loopback")
    return problems


def interpolated(text: str, env: dict[str, str]) -> str:
    """Compose interpolation: ${VAR:-default} is VAR when set and not empty, else default; ${VAR} is VAR or ''."""

    def value(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        return (env.get(name) or default) if default is not None else env.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", value, text)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a Compose --env-file (comments and blank lines skipped)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


# ---------------------------------------------------------------- compose


def check_compose(path: Path) -> list[str]:
    """The Compose file as it renders with its defaults and with each *.env file beside it."""
    problems = check_compose_variant(path, {}, "compose")
    for env_file in sorted(path.parent.glob("*.env")):
        problems += check_compose_variant(path, read_env_file(env_file), f"compose (--env-file {env_file.name})")
    return problems


def check_compose_variant(path: Path, outer: dict[str, str], where: str) -> list[str]:
    """One rendering: its services, Prometheus config and the Grafana provisioning agree with each other."""
    problems: list[str] = []
    base = path.parent
    compose = yaml.safe_load(interpolated(path.read_text(), outer))
    profiles = {p for p in outer.get("COMPOSE_PROFILES", "").split(",") if p}
    services: dict[str, dict[str, Any]] = {
        n: s for n, s in compose.get("services", {}).items() if not s.get("profiles") or profiles & set(s["profiles"])
    }

    def role(service: dict[str, Any]) -> str | None:
        command = [str(c) for c in service.get("command", [])]
        return command[0] if command and command[0] in ROLES else None

    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith((".", "/")) and not (base / source).exists():
                problems.append(f"{where}: service {name} mounts {source}, which does not exist next to {path.name}")

    servers = [n for n, s in services.items() if role(s) == "ps"]
    workers = {n: s for n, s in services.items() if role(s) == "worker"}
    stores = [n for n, s in services.items() if role(s) == "store"]
    if not servers or len(stores) > 1:
        found = f"found servers {servers}, coordinators {stores}"
        return [*problems, f"{where}: expected one server service ('ps ...') or a replica set of them, at most one coordinator ('store ...'); {found}"]
    envs = {n: env_map(s, outer) for n, s in services.items()}
    commands = {n: [str(c) for c in s.get("command", [])] for n, s in services.items()}
    join, join_problems = _compose_replicas(where, servers, stores, commands, envs)
    problems += join_problems
    metrics_port: dict[str, int] = {}
    for name in [*servers, *stores, *workers]:
        default = {"ps": SERVER_METRICS_DEFAULT, "store": STORE_METRICS_DEFAULT}.get(commands[name][0], WORKER_METRICS_DEFAULT)
        metrics_port[name] = int(setting(commands[name], envs[name], "--metrics-port", str(default)) or default)
    slots: list[int] = []
    for name in workers:
        command, env = commands[name], envs[name]
        ps = flag(command, "--ps") or env.get("RPCPS_PS")
        if ps != join:
            what = "the group's coordinator" if stores else "the server"
            problems.append(f"{where}: worker {name} has --ps {ps}, but {what} is {join}")
        num = flag(command, "--num-workers") or env.get("RPCPS_NUM_WORKERS")
        if num is None or int(num) != len(workers):
            problems.append(f"{where}: worker {name} has --num-workers {num}, but there are {len(workers)} worker services")
        index = flag(command, "--worker-index") or env.get("RPCPS_WORKER_INDEX")
        if index is None:
            problems.append(f"{where}: worker {name} sets no --worker-index / RPCPS_WORKER_INDEX")
        else:
            slots.append(int(index))
    if sorted(slots) != list(range(len(workers))):
        problems.append(f"{where}: worker slots {sorted(slots)} are not 0..{len(workers) - 1}, each once")
    for name in [*servers, *stores, *workers]:
        problems += exposure_problems(f"{where}: service {name}", commands[name][0], commands[name], envs[name])
        problems += unknown_settings(f"{where}: service {name}", commands[name][0], commands[name][1:], envs[name])
        problems += thread_settings(f"{where}: service {name}", commands[name][1:], envs[name])
        problems += restart_layers(f"{where}: service {name}", commands[name][0], commands[name][1:], envs[name],
                                   "Docker's restart policy")

    prometheus = next((s for s in services.values() if "prom/prometheus" in str(s.get("image", ""))), None)
    if prometheus is None:
        problems.append(f"{where}: no Prometheus service")
    else:
        expected = {
            JOBS["ps"]: {f"{n}:{metrics_port[n]}" for n in servers},
            JOBS["worker"]: {f"{n}:{metrics_port[n]}" for n in workers},
            STORE_JOB: {f"{n}:{metrics_port[n]}" for n in stores},
        }
        problems += _check_compose_prometheus(where, base, prometheus, expected)
    grafana_name = next((n for n, s in services.items() if "grafana/grafana" in str(s.get("image", ""))), None)
    if grafana_name is None:
        problems.append(f"{where}: no Grafana service")
    else:
        prom_name = next(n for n, s in services.items() if s is prometheus) if prometheus else None
        problems += _check_compose_grafana(where, base, services[grafana_name], prom_name)
    return problems


def _compose_replicas(
    where: str, servers: list[str], stores: list[str], commands: dict[str, list[str]], envs: dict[str, dict[str, str]]
) -> tuple[str, list[str]]:
    """The address workers must join, and what is wrong with the server replicas and their coordinator.

    Every server runs the same command (replicas are interchangeable: whichever claims the shard
    first is the primary), with --replicas equal to the number of servers; more than one needs the
    coordinator, and then every server joins it with --store.
    """
    problems = []
    first = servers[0]
    for name in servers[1:]:
        if commands[name] != commands[first]:
            problems.append(f"{where}: server {name} runs {commands[name]}, not the command of {first}: replicas run the same command")
    for name in servers:
        replicas = int(setting(commands[name], envs[name], "--replicas", "1") or 1)
        if replicas != len(servers):
            problems.append(f"{where}: server {name} has --replicas {replicas}, but {len(servers)} server service(s) run "
                            "(a standby service needs --replicas 2 on both)")
    if stores:
        store_listen = setting(commands[stores[0]], envs[stores[0]], "--listen", "127.0.0.1:29500") or ""
        join = f"{stores[0]}:{store_listen.rsplit(':', 1)[1]}"
        for name in servers:
            store = setting(commands[name], envs[name], "--store")
            if store != join:
                problems.append(f"{where}: server {name} has --store {store}, but the coordinator is {join}")
        return join, problems
    if len(servers) > 1:
        problems.append(f"{where}: {len(servers)} server services run without a coordinator ('store' service): a standby cannot "
                        "take over from a primary that hosts the group's store")
    for name in servers:
        store = setting(commands[name], envs[name], "--store")
        if store is not None:
            problems.append(f"{where}: server {name} has --store {store}, but no coordinator ('store' service) runs")
    listen = setting(commands[first], envs[first], "--listen", f"0.0.0.0:{RPC_PORT_DEFAULT}") or ""
    return f"{first}:{listen.rsplit(':', 1)[1]}", problems


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """{container path: host source} of a Compose service's volumes."""
    found = {}
    for volume in service.get("volumes", []):
        parts = str(volume).split(":")
        if len(parts) >= 2:
            found[parts[1]] = parts[0]
    return found


def _check_compose_prometheus(where: str, base: Path, prometheus: dict[str, Any], expected: dict[str, set[str]]) -> list[str]:
    """Prometheus scrapes exactly the running services of each job: a target that does not run would
    fire its down alert, one that runs unscraped is not watched."""
    problems = []
    mounts = _mounts(prometheus)
    config_file = flag(prometheus.get("command", []), "--config.file") or "/etc/prometheus/prometheus.yml"
    if config_file not in mounts:
        return [f"{where}: Prometheus reads {config_file}, which no volume provides"]
    config = yaml.safe_load((base / mounts[config_file]).read_text())
    for rule_file in config.get("rule_files", []):
        in_container = str(Path(config_file).parent / rule_file)
        if in_container not in mounts:
            problems.append(f"{where}: Prometheus loads rules {in_container}, which no volume provides")
    targets = {job["job_name"]: {t for group in job.get("static_configs", []) for t in group["targets"]}
               for job in config.get("scrape_configs", [])}
    for job, want in expected.items():
        if targets.get(job, set()) != want:
            problems.append(f"{where}: Prometheus job {job} scrapes {sorted(targets.get(job, []))}, expected {sorted(want)} "
                            f"({mounts[config_file]})")
    return problems


def _check_compose_grafana(where: str, base: Path, grafana: dict[str, Any], prometheus_service: str | None) -> list[str]:
    problems = []
    mounts = _mounts(grafana)
    provisioning = mounts.get("/etc/grafana/provisioning")
    if provisioning is None:
        return [f"{where}: Grafana has no /etc/grafana/provisioning mount"]
    root = base / provisioning
    dashboards = [p for f in sorted((root / "dashboards").glob("*.y*ml")) for p in yaml.safe_load(f.read_text())["providers"]]
    paths = [p["options"]["path"] for p in dashboards]
    mounted_dashboards = [c for c, s in mounts.items() if s.endswith(".json")]
    for container_path in mounted_dashboards:
        if not any(container_path.startswith(p.rstrip("/") + "/") for p in paths):
            problems.append(f"{where}: dashboard mounted at {container_path} is outside every provider path {paths}")
    if not mounted_dashboards:
        problems.append(f"{where}: no dashboard JSON mounted into Grafana")
    env = env_map(grafana)
    for f in sorted((root / "datasources").glob("*.y*ml")):
        for source in yaml.safe_load(f.read_text())["datasources"]:
            url = str(source["url"])
            for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", url):
                if var not in env:
                    problems.append(f"{where}: data source {source['name']} needs {var}, which Grafana's environment lacks")
                url = re.sub(r"\$\{?" + var + r"\}?", env.get(var, ""), url)
            host = urlparse(url).hostname
            if prometheus_service and host != prometheus_service:
                problems.append(f"{where}: data source {source['name']} points at {url}, not the {prometheus_service} service")
    return problems


# ---------------------------------------------------------------- kubernetes


def load_documents(paths: Iterable[Path]) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


def _pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, workload, pod template) of every StatefulSet, Job and Deployment."""
    for d in docs:
        if d["kind"] in ("StatefulSet", "Job", "Deployment"):
            yield d["metadata"]["name"], d, d["spec"]["template"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_ports(template: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", []) if "name" in p}


def check_k8s(docs: list[dict[str, Any]]) -> list[str]:
    """Services, workloads, probes, env, network policy and ServiceMonitor agree with each other."""
    problems: list[str] = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    pods = list(_pods(docs))

    for name, service in services.items():
        selected = [(w, t) for w, _, t in pods if _selects(service["spec"]["selector"], t["metadata"]["labels"])]
        if not selected:
            problems.append(f"k8s: Service {name} selects no pods")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload, template in selected:
                ports = _container_ports(template)
                if isinstance(target, str) and target not in ports:
                    problems.append(f"k8s: Service {name} port {port['name']} targets {target!r}, which {workload} does not name")

    for workload, spec, template in pods:
        ports = _container_ports(template)
        numbers = set(ports.values())
        for c in template["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe and "grpc" in probe and probe["grpc"]["port"] not in numbers:
                    problems.append(f"k8s: {workload} {kind} probes port {probe['grpc']['port']}, not a container port")
            annotations = template["metadata"].get("annotations", {})
            scrape_port = int(annotations.get("prometheus.io/port", -1))
            if annotations.get("prometheus.io/scrape") == "true" and scrape_port != ports.get("metrics"):
                problems.append(f"k8s: {workload} prometheus.io/port {scrape_port} is not its metrics port {ports.get('metrics')}")
            problems += _check_secret_mounts(workload, c, template)
            args = [str(a) for a in c.get("args", [])]
            if args and args[0] in ROLES:
                problems += exposure_problems(f"k8s: {workload}", args[0], args, env_list(c))
                problems += unknown_settings(f"k8s: {workload}", args[0], args[1:], env_list(c))
                problems += thread_settings(f"k8s: {workload}", args[1:], env_list(c))
                problems += restart_layers(f"k8s: {workload}", args[0], args[1:], env_list(c), "the kubelet")
        if spec["kind"] == "Job":
            problems += _check_worker_job(spec, template, services, pods)
        if spec["kind"] == "StatefulSet":
            problems += _check_server_set(spec, template, services, pods, docs)
        if _role(template) == "store":
            problems += _check_coordinator(spec)

    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        problems += _check_network_policy(policy, pods)
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        problems += _check_service_monitor(monitor, services, pods)
    return problems


def _check_secret_mounts(workload: str, container: dict[str, Any], template: dict[str, Any]) -> list[str]:
    """The control token and the job secret are read from files that a Secret volume provides."""
    problems = []
    secrets = {v["name"] for v in template["spec"].get("volumes", []) if "secret" in v}
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", []) if m["name"] in secrets]
    for what, name in (("control token", "--control-token-file"), ("job secret", "--job-secret-file")):
        path = setting(container.get("args", []), env_list(container), name)
        if path is not None and not any(str(path).startswith(m) for m in mounts):
            problems.append(f"k8s: {workload} reads its {what} from {path}, which no Secret volume is mounted over")
    return problems


def _role(template: dict[str, Any]) -> str | None:
    """The rpcps role a pod template runs (its first container's first argument), if any."""
    args = template["spec"]["containers"][0].get("args", [])
    return str(args[0]) if args and str(args[0]) in ROLES else None


def _coordinator_address(address: Any, services: dict[str, Any], pods: list) -> str | None:
    """Why ``address`` is not SERVICE[.NAMESPACE...]:PORT of a Service in front of the coordinator, or None when it is."""
    match = re.fullmatch(r"([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", str(address))
    if match is None or match.group(1) not in services:
        return f"{address!r} is not SERVICE:PORT of a Service"
    service = services[match.group(1)]
    if not any(_role(t) == "store" and _selects(service["spec"]["selector"], t["metadata"]["labels"]) for _, _, t in pods):
        return f"Service {match.group(1)} does not select the coordinator's pods (args 'store ...')"
    if int(match.group(2)) not in {p["port"] for p in service["spec"]["ports"]}:
        return f"port {match.group(2)} is not a port of Service {match.group(1)}"
    return None


def _check_coordinator(deployment: dict[str, Any]) -> list[str]:
    name = deployment["metadata"]["name"]
    spec = deployment["spec"]
    if deployment["kind"] != "Deployment" or spec.get("replicas", 1) != 1 or spec.get("strategy", {}).get("type") != "Recreate":
        why = "two coordinators at once would split the group"
        return [f"k8s: the coordinator {deployment['kind']} {name} must be a Deployment of replicas 1 with strategy Recreate: {why}"]
    return []


def _check_worker_job(job: dict[str, Any], template: dict[str, Any], services: dict[str, Any], pods: list) -> list[str]:
    problems = []
    name = job["metadata"]["name"]
    spec = job["spec"]
    if spec.get("completionMode") != "Indexed":
        problems.append(f"k8s: Job {name} must be Indexed (its completion index is the worker slot)")
    container = template["spec"]["containers"][0]
    env = env_list(container)
    index = env.get("RPCPS_WORKER_INDEX")
    if not (isinstance(index, dict) and index.get("fieldRef", {}).get("fieldPath") == COMPLETION_INDEX):
        problems.append(f"k8s: Job {name} must take RPCPS_WORKER_INDEX from the {COMPLETION_INDEX} field")
    num = env.get("RPCPS_NUM_WORKERS")
    if num is None or int(num) != spec.get("completions") or spec.get("parallelism") != spec.get("completions"):
        problems.append(f"k8s: Job {name} runs completions={spec.get('completions')} parallelism={spec.get('parallelism')} "
                        f"but RPCPS_NUM_WORKERS={num}: all three must be equal")
    ps = flag(container.get("args", []), "--ps") or env.get("RPCPS_PS")
    if any(_role(t) == "store" for _, _, t in pods):  # with a coordinator, everyone joins the group there
        why = _coordinator_address(ps, services, pods)
        if why is not None:
            problems.append(f"k8s: Job {name} --ps must name the coordinator, which the servers join: {why}")
    else:
        problems += _check_server_address(f"Job {name} --ps", ps, services, pods)
    if template["spec"].get("restartPolicy") == "Never" and "podFailurePolicy" not in spec:
        problems.append(f"k8s: Job {name} has no podFailurePolicy: exit codes 2/4/5 would be retried for nothing")
    return problems


def _check_server_address(what: str, address: Any, services: dict[str, Any], pods: list) -> list[str]:
    """``address`` must be POD.SERVICE:PORT of a StatefulSet pod behind its headless Service."""
    match = re.fullmatch(r"([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", str(address))
    if match is None:
        return [f"k8s: {what} is {address!r}, expected STATEFULSET-0.SERVICE:PORT"]
    workload, _, service, port = match.groups()
    sets = {w: s for w, s, _ in pods if s["kind"] == "StatefulSet"}
    if workload not in sets or sets[workload]["spec"].get("serviceName") != service or service not in services:
        return [f"k8s: {what} names {workload}-N.{service}, which is not a StatefulSet pod behind its Service"]
    if int(port) not in {p["port"] for p in services[service]["spec"]["ports"]}:
        return [f"k8s: {what} port {port} is not a port of Service {service}"]
    return []


def _check_server_set(sts: dict[str, Any], template: dict[str, Any], services: dict[str, Any], pods: list,
                      docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    name = sts["metadata"]["name"]
    service = services.get(sts["spec"].get("serviceName", ""))
    if service is None or service["spec"].get("clusterIP") != "None":
        problems.append(f"k8s: StatefulSet {name} needs its serviceName to be a headless Service (stable DNS)")
    elif not service["spec"].get("publishNotReadyAddresses"):
        problems.append(f"k8s: Service {service['metadata']['name']} should publish not-ready addresses: workers must "
                        "resolve the server while it resumes")
    container = template["spec"]["containers"][0]
    env = env_list(container)
    args = container.get("args", [])
    shards = int(env.get("RPCPS_SHARDS", 1))
    replicas = int(setting(args, env, "--replicas", "1") or 1)
    if shards * replicas != sts["spec"].get("replicas", 1):
        per_shard = f" x RPCPS_REPLICAS={replicas}" if replicas > 1 else ""
        problems.append(f"k8s: StatefulSet {name} has replicas={sts['spec'].get('replicas', 1)} but RPCPS_SHARDS={shards}{per_shard}")
    index = env.get("RPCPS_SHARD_INDEX")
    if replicas > 1:
        problems += _check_replica_set(name, sts, template, shards, index, setting(args, env, "--store"), services, pods)
    elif (shards > 1 or index is not None) and not (isinstance(index, dict) and index.get("fieldRef", {}).get("fieldPath") == POD_INDEX):
        problems.append(f"k8s: StatefulSet {name} must take RPCPS_SHARD_INDEX from {POD_INDEX}")
    claims = {c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])}
    ckpt = setting(args, env, "--checkpoint-dir")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volume = mounts.get(str(ckpt))
    if replicas == 1 and (ckpt is None or volume not in claims):
        problems.append(f"k8s: StatefulSet {name} must keep --checkpoint-dir ({ckpt}) on a volumeClaimTemplate")
    if replicas > 1 and not _shared_claim(template, volume, docs):
        problems.append(f"k8s: StatefulSet {name} runs replicas of one shard: --checkpoint-dir ({ckpt}) must be one "
                        "ReadWriteMany PersistentVolumeClaim they share, not a volume per pod (a replica that never was "
                        "primary holds no snapshot, and may claim the shard first after a full restart)")
    return problems


def _check_replica_set(name: str, sts: dict[str, Any], template: dict[str, Any], shards: int, index: Any, store: str | None,
                       services: dict[str, Any], pods: list) -> list[str]:
    """A StatefulSet whose pods are the replicas of one shard (--replicas > 1)."""
    problems = []
    if shards != 1 or index not in (None, "0"):
        problems.append(f"k8s: StatefulSet {name} runs replicas of one shard: RPCPS_SHARDS must be 1 and RPCPS_SHARD_INDEX "
                        "\"0\" (a pod index cannot be split into shard and replica)")
    why = _coordinator_address(store, services, pods)
    if why is not None:
        problems.append(f"k8s: StatefulSet {name} has replicas of a shard, so RPCPS_STORE must name the coordinator: {why}")
    anti = template["spec"].get("affinity", {}).get("podAntiAffinity", {})
    terms = [*anti.get("requiredDuringSchedulingIgnoredDuringExecution", []),
             *(t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", []))]
    labels = template["metadata"]["labels"]
    if not any(t.get("topologyKey") == "kubernetes.io/hostname" and _selects(t["labelSelector"].get("matchLabels", {}), labels)
               for t in terms):
        problems.append(f"k8s: StatefulSet {name} runs replicas of one shard without a podAntiAffinity on kubernetes.io/hostname: "
                        "a standby on its primary's node does not survive that node")
    return problems


def _shared_claim(template: dict[str, Any], volume: str | None, docs: list[dict[str, Any]]) -> bool:
    """Whether the pod volume ``volume`` is a PersistentVolumeClaim of the documents with access mode ReadWriteMany."""
    source = next((v for v in template["spec"].get("volumes", []) if v["name"] == volume), {})
    claim = source.get("persistentVolumeClaim", {}).get("claimName")
    return any(d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim
               and "ReadWriteMany" in d["spec"].get("accessModes", []) for d in docs)


def _check_network_policy(policy: dict[str, Any], pods: list) -> list[str]:
    name = policy["metadata"]["name"]
    selector = policy["spec"]["podSelector"].get("matchLabels", {})
    covered = [w for w, _, t in pods if _selects(selector, t["metadata"]["labels"])]
    problems = []
    if sorted(covered) != sorted(w for w, _, _ in pods):
        problems.append(f"k8s: NetworkPolicy {name} covers {covered}, not every rpcps pod")
    all_ports_between_pods = False
    for rule in policy["spec"].get("ingress", []):
        peers = [p.get("podSelector", {}).get("matchLabels") for p in rule.get("from", []) if "namespaceSelector" not in p]
        if any(p is not None and all(_selects(p, t["metadata"]["labels"]) for _, _, t in pods) for p in peers):
            ports = rule.get("ports")
            if ports is None or any("port" not in p and p.get("protocol", "TCP") == "TCP" for p in ports):
                all_ports_between_pods = True
    if not all_ports_between_pods:
        problems.append(f"k8s: NetworkPolicy {name} must let rpcps pods reach each other on every TCP port "
                        "(TensorPipe listens on an ephemeral port in each pod)")
    return problems


def _check_service_monitor(monitor: dict[str, Any], services: dict[str, Any], pods: list) -> list[str]:
    name = monitor["metadata"]["name"]
    selector = monitor["spec"]["selector"].get("matchLabels", {})
    selected = {n: s for n, s in services.items() if _selects(selector, s["metadata"].get("labels", {}))}
    problems = []
    if set(JOBS.values()) - set(selected):
        problems.append(f"k8s: ServiceMonitor {name} selects Services {sorted(selected)}; the alerts need jobs {sorted(JOBS.values())} "
                        "(the operator names the job after the Service)")
    for endpoint in monitor["spec"]["endpoints"]:
        for service_name, service in selected.items():
            if endpoint.get("port") not in {p["name"] for p in service["spec"]["ports"]}:
                problems.append(f"k8s: ServiceMonitor {name} scrapes port {endpoint.get('port')!r}, which Service {service_name} lacks")
    return problems


# ---------------------------------------------------------------- env files of the node launcher

LAUNCHERS = (REPO / "deploy" / "bare-metal" / "rpcps-node.sh", REPO / "deploy" / "slurm" / "rpcps.sbatch")


def check_env_file(path: Path) -> list[str]:
    """Every RPCPS_* setting of a launcher env file (commented-out examples too) is one that rpcps or
    the launchers read: a misspelt one is silently ignored by both."""
    variables = frozenset().union(*(names for _, names in cli_settings().values()))
    launchers = frozenset(name for script in LAUNCHERS for name in re.findall(r"RPCPS_[A-Z0-9_]+", script.read_text()))
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.fullmatch(r"#?\s*(RPCPS_[A-Z0-9_]+)=.*", line.strip())
        if match and match.group(1) not in variables | launchers:
            problems.append(f"{path.name}:{number}: neither rpcps nor its launchers read {match.group(1)}")
        setting = re.fullmatch(r"([A-Z0-9_]+)=.*", line.strip())
        if setting:
            problems += thread_settings(f"{path.name}:{number}", [], [setting.group(1)])
    return problems


# ---------------------------------------------------------------- rendering without kubectl


class CannotRender(Exception):
    """The kustomization uses what this renderer does not do, or a patch does not apply: it says which."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The documents of a kustomization, for the subset of kustomize that deploy/k8s uses: resources
    (files and directories), a namespace, and inline JSON 6902 patches by kind and name. Anything else
    is refused rather than rendered wrongly; kubectl kustomize renders the rest."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    if unsupported:
        raise CannotRender(f"{directory}: cannot render {sorted(unsupported)} without kubectl")
    docs: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else load_documents([path])
    for patch in kustomization.get("patches", []):
        ops = yaml.safe_load(patch.get("patch", "")) if "target" in patch else None
        if not isinstance(ops, list):
            raise CannotRender(f"{directory}: only inline JSON 6902 patches with a target render without kubectl")
        target = patch["target"]
        matched = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        if not matched:
            raise CannotRender(f"{directory}: a patch targets {target['kind']} {target['name']}, which no resource is")
        for doc in matched:
            for op in ops:
                _apply(doc, op, f"{directory}: {target['kind']} {target['name']}")
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = kustomization["namespace"]
    return docs


def _apply(doc: dict[str, Any], op: dict[str, Any], where: str) -> None:
    """One JSON patch operation (RFC 6902: add, remove, replace, test) on ``doc``, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    index: Any = last if isinstance(node, dict) else (len(node) if last == "-" else int(last))
    kind = op["op"]
    if kind == "test" and node[index] != op["value"]:
        raise CannotRender(f"{where}: patch test failed at {op['path']}: {node[index]!r} is not {op['value']!r}")
    if kind == "remove":
        del node[index]
    elif kind == "replace":
        node[index] = op["value"]
    elif kind == "add" and isinstance(node, list):
        node.insert(index, op["value"])
    elif kind == "add":
        node[index] = op["value"]
    elif kind != "test":
        raise CannotRender(f"{where}: JSON patch op {kind!r} does not render without kubectl")


# ---------------------------------------------------------------- prometheus


def without_k8s_sd(config: dict[str, Any]) -> dict[str, Any]:
    """The config with every kubernetes_sd_configs replaced by an empty static list.

    Debian's promtool is built without Kubernetes discovery and refuses the whole file; with the
    discovery swapped out, promtool still checks everything else (relabel rules, rule files).
    """
    for job in config.get("scrape_configs", []):
        if job.pop("kubernetes_sd_configs", None) is not None:
            job.setdefault("static_configs", []).append({"targets": []})
    return config


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    command, *paths = argv
    if command == "compose" and len(paths) == 1:
        problems = check_compose(Path(paths[0]))
    elif command == "k8s" and paths[:1] == ["--each"] and "--with" in paths[2:]:
        # One process for every rendering: importing the command line (for the flags) costs 2-4 s.
        renderings, shared = paths[1:paths.index("--with")], [Path(p) for p in paths[paths.index("--with") + 1:]]
        problems = [f"{Path(r).stem}: {problem}" for r in renderings for problem in check_k8s(load_documents([Path(r), *shared]))]
    elif command == "k8s" and paths:
        problems = check_k8s(load_documents(Path(p) for p in paths))
    elif command == "env-file" and len(paths) == 1:
        problems = check_env_file(Path(paths[0]))
    elif command == "render" and len(paths) == 1:
        try:
            print(yaml.safe_dump_all(render(Path(paths[0])), sort_keys=False), end="")
        except (CannotRender, KeyError, IndexError) as e:
            print(f"check_deploy render: {e}", file=sys.stderr)
            return 1
        return 0
    elif command == "prometheus-without-k8s-sd" and len(paths) == 2:
        config = without_k8s_sd(yaml.safe_load(Path(paths[0]).read_text()))
        Path(paths[1]).write_text(yaml.safe_dump(config, sort_keys=False))
        return 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
