#!/usr/bin/env bash
# One command on a GPU machine (torch preinstalled, no network; the wheels in .whl/ from
# `python tools/offline_deps.py download`): bash tools/gpu_check.sh [--json out.json] [gpu_check.py options]
set -euo pipefail; cd "$(dirname "$0")/.."; python tools/offline_deps.py install && PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python tools/gpu_check.py "$@"
