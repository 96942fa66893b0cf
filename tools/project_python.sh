#!/usr/bin/env bash
# Prints the interpreter project scripts run Python with: $PYTHON, else the repository's .venv (what
# tools/setup.sh makes), else python3 from PATH. Scripts call it as
#   python="${PYTHON:-$(bash "$repo/tools/project_python.sh")}"
# so a fresh machine set up by tools/setup.sh never falls back to a system Python without the
# project's packages.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
elif [[ -x "$repo/.venv/bin/python" ]]; then
    echo "$repo/.venv/bin/python"
else
    echo python3
fi
