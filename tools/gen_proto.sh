#!/usr/bin/env bash
# Regenerates the Python code of the control-plane API from ps/control/control.proto, and the etcd
# client stubs from rpcps/etcd/{kv,rpc}.proto (the subset of etcd's own API that rpcps calls).
#
# Run from anywhere; it works from the repository root so that protoc sees the file as
# ps/control/control.proto and the generated gRPC module imports `ps.control.control_pb2`
# (package-qualified) rather than a top-level `control_pb2` that would not resolve.
#
# Usage: tools/gen_proto.sh [OUT_DIR]   (default: the repository root, i.e. in place)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
mkdir -p "$out"
cd "$root"
"${PYTHON:-$(bash "$root/tools/project_python.sh")}" -m grpc_tools.protoc -I. \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  ps/control/control.proto rpcps/etcd/kv.proto rpcps/etcd/rpc.proto
