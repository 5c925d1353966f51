#!/usr/bin/env bash
# The GPU check, one prepared run of under 5 minutes on a machine with a CUDA GPU; prints one table:
#   - DDP over NCCL at world size 1 takes bitwise the same steps as the plain model,
#   - the device-mismatch errors name the culprit on CUDA (a pinned buffer, a tensor made in forward()),
#   - FSDP2 (fully_shard over NCCL) trains the same weights as DDP, and its model.pt has the same keys and shapes,
#   - throughput of the seed Network at global batch 512, 1024, 4096: fp32, bf16, bf16 + torch.compile, bf16
#     through the DataLoader (the device-resident data path's gain on this GPU), and fsdp with the bf16
#     mixed-precision policy (bf16 parameters, fp32 gradient reduction); samples/s, step time, MFU,
#   - the built-in GPT (6 layers, 6 heads, 384 wide, context 256: nanoGPT's Shakespeare-char size) on the README's
#     bytes in bf16, under ddp and fsdp: tokens/s, MFU (6 x parameters + 12 x layers x heads x head_dim x seq_len
#     FLOPs per token), peak device memory.
# From the repository root, installing nothing (torch >= 2.10 is all it needs; the GPU image has 2.11):
#   bash scripts/gpu_check.sh [--json gpu_check.json] [--budget-s 240]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device is visible (torch {torch.__version__}); run this on a GPU machine")'

# The python part stops starting throughput runs after --budget-s; timeout is the backstop for a hang.
exec timeout --kill-after=10 290 "$PYTHON" scripts/gpu_check.py --device cuda "$@"
