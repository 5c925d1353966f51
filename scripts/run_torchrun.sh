#!/usr/bin/env bash
# One node, N workers, through plain torchrun (the reference our launcher must match); extra arguments go to the
# trainer. Environment overrides:
#   NPROC=2 CONFIG=configs/ddp_cpu.toml LOG_RANKS=0 scripts/run_torchrun.sh --set train.epochs=1
# NPROC: workers (default 2); CONFIG: the TOML file; LOG_RANKS: local ranks whose output is shown (default: all).
set -euo pipefail
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-$(dirname "$0")/../configs/ddp_cpu.toml}
PYTHON=${PYTHON:-python}
filter=()
[ -n "${LOG_RANKS:-}" ] && filter=(--local-ranks-filter "$LOG_RANKS")
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "${filter[@]}" \
  -m distrib train --config "$CONFIG" "$@"
