#!/usr/bin/env bash
# Static checks of the monitoring bundle: the Prometheus config, the alert rules and their unit
# tests, and the Grafana dashboard's PromQL. Needs promtool (Debian: apt-get install prometheus)
# and python with prometheus-client and PyYAML ($PYTHON, default: the repository's .venv). Run from anywhere:
#   bash deploy/check.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
promtool="${PROMTOOL:-promtool}"
python="${PYTHON:-$(bash "$repo/tools/project_python.sh")}"

if ! command -v "$promtool" >/dev/null 2>&1; then
    echo "deploy/check.sh: promtool not found; install Prometheus (Debian: apt-get install prometheus) or set PROMTOOL=/path/to/promtool" >&2
    exit 2
fi

step() { printf '== %s\n' "$*"; }

# promtool resolves rule_files relative to the config file, so these run from deploy/prometheus.
# check config warns (and still passes) when the example file_sd directory does not exist here.
step "promtool check config"
(cd "$here/prometheus" && "$promtool" check config prometheus.yml)

step "promtool check rules"
(cd "$here/prometheus" && "$promtool" check rules alerts.yml)

step "promtool test rules"
(cd "$here/prometheus" && "$promtool" test rules alerts_test.yml)

step "dashboard and alert expressions: PromQL parses, metrics exist"
"$python" "$repo/tools/check_dashboard.py" --promtool "$promtool" \
    "$here/grafana/rpcps-dashboard.json" --rules "$here/prometheus/alerts.yml"

step "all monitoring checks passed"
