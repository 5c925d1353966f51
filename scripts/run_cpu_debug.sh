#!/usr/bin/env bash
# One CPU process, no launcher and no ports: the quickest way to step through the trainer (pdb works).
#   scripts/run_cpu_debug.sh --set train.max_steps=20
#   CONFIG=configs/debug_cpu.toml scripts/run_cpu_debug.sh
set -euo pipefail
CONFIG=${CONFIG:-$(dirname "$0")/../configs/debug_cpu.toml}
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m distrib train --config "$CONFIG" --set dist.device=cpu "$@"
