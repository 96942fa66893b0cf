#!/usr/bin/env bash
# Sets up rpcps in ./.venv on a fresh machine (Python 3.11+), with the examples' extra (scikit-learn,
# whose bundled digits the digits example trains on) and safetensors (`rpcps export --out X.safetensors`),
# and compiles the RPC request filter (rpcps/transport/native: C++ against this exact torch, so it
# needs g++, ninja and Python's headers, installed from Debian when missing; root or sudo then).
# With --test, also what the tests need: the test extras and Debian packages (needs root or sudo). CI
# fails when a test that needs one of them skips (tests/must_run.txt), so whatever a listed test needs
# is installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "rpcps needs Python 3.11 or newer"'

apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement on an empty environment pulls a multi-GB CUDA
# build; pyproject.toml keeps a version range so a newer torch still satisfies it.
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==${RPCPS_TORCH_VERSION:-2.13.0}"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[examples,safetensors,test]'
  # prometheus: prometheus + promtool; iproute2: `ip netns` for the multi-host test and `ss`;
  # systemd: systemd-analyze for deploy/validate.sh; openssl: the TLS tests' certificates;
  # etcd-server, etcd-client: the 3-member etcd cluster of the `--store etcd://` tests (etcd, etcdctl).
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v shellcheck >/dev/null \
      || ! command -v ip >/dev/null || ! command -v ss >/dev/null || ! command -v systemd-analyze >/dev/null \
      || ! command -v openssl >/dev/null || ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    apt_install prometheus shellcheck iproute2 systemd openssl etcd-server etcd-client
  fi
else
  .venv/bin/python -m pip install -q -e '.[examples,safetensors]'
fi

# Every rpcps process refuses to start without the request filter built for the torch it runs; a
# torch upgrade needs this line again (the error says so).
headers=$(.venv/bin/python -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null || [ "$headers" != "True" ]; then
  apt_install g++ ninja-build python3-dev
fi
.venv/bin/python -m rpcps.transport.native
if [ "${1:-}" = "--test" ]; then
  # The hostile-peer test's native sender (test support, cached per torch under the temporary folder):
  # built here so the test run does not spend its first half-minute compiling.
  .venv/bin/python -c 'from tests.integration.security import script_call_sender; script_call_sender.load()'
fi
echo "rpcps is set up in $(pwd)/.venv"
