#!/usr/bin/env bash
# The GPU check, one prepared run of under 5 minutes on a machine with a CUDA GPU; prints one table:
#   - DDP over NCCL at world size 1 takes bitwise the same steps as the plain model,
#   - the device-mismatch errors name the culprit on CUDA (a pinned buffer, a tensor made in forward()),
#   - FSDP2 (fully_shard over NCCL) trains the same weights as DDP, and its model.pt has the same keys and shapes,
#   - throughput of the seed Network at global batch 512, 1024, 4096: fp32, bf16, bf16 + torch.compile, bf16
#     through the DataLoader (the device-resident data path's gain on this GPU), and fsdp with the bf16
#     mixed-precision policy (bf16 parameters, fp32 gradient reduction); samples/s, step time, MFU,
#   - the built-in GPT (6 layers, 6 heads, 384 wide, context 256: nanoGPT's Shakespeare-char size) on the docs'
#     bytes (README.md and docs/*.md) in bf16, under ddp, fsdp, hsdp (a 1 x N mesh), tensor parallel 2 x fsdp and
#     pipeline parallel 2 x fsdp (1f1b, untied): tokens/s, MFU (6 x parameters + 12 x layers x heads x head_dim x
#     seq_len FLOPs per token), peak device memory; on one GPU in this process (tensor and pipeline parallel skipped:
#     they need 2), then with 2+ GPUs again on all of them under distrib launch.
#   - the same GPT under fsdp with speed.compile (each Block compiled in place before fully_shard): tokens/s against
#     the fsdp row above it, its compiling left out of the figures (--skip).
# From the repository root, installing nothing (torch >= 2.10 is all it needs; the GPU image has 2.11):
#   bash scripts/gpu_check.sh [--json gpu_check.json] [--budget-s 240]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device is visible (torch {torch.__version__}); run this on a GPU machine")'

GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
# The python part stops starting throughput runs after --budget-s; timeout is the backstop for a hang. With several
# GPUs the budget is shared: 170 s in one process, then every strategy of the GPT on all GPUs (5 minutes in all).
if [ "$GPUS" -lt 2 ]; then
  exec timeout --kill-after=10 290 "$PYTHON" scripts/gpu_check.py --device cuda "$@"
fi
rc=0
timeout --kill-after=10 180 "$PYTHON" scripts/gpu_check.py --device cuda --budget-s 150 "$@" || rc=$?
timeout --kill-after=10 110 "$PYTHON" -m distrib launch --nproc-per-node "$GPUS" scripts/gpu_check.py --device cuda \
  --gpt-only --budget-s 80 --steps 60 --skip 10 || rc=$?
exit "$rc"
