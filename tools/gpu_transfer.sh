#!/usr/bin/env bash
# CUDA analogues of the transfer kinds on a GPU machine: the GPU tests, then the three-way benchmark on
# one GPU (destination on the same GPU) and, with two or more GPUs, peer to peer (cuda:0 -> cuda:1).
# Results (JSON, PNG, logs) go to $OUT (default ./gpu_transfer_out). Needs torch with CUDA and triton.
#
#   tools/gpu_transfer.sh            # full sweep
#   QUICK=1 tools/gpu_transfer.sh    # three small cases
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_transfer_out}"
mkdir -p "$OUT"
extra=()
[[ "${QUICK:-0}" == 1 ]] && extra+=(--quick)

{
  date -u +"date %Y-%m-%d %H:%M:%S UTC"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/hardware.txt"

python3 -m pytest -q -m cuda tests/transport/test_cuda.py 2>&1 | tee "$OUT/tests.txt"

CUDA_VISIBLE_DEVICES="${GPU0:-0}" python3 -m ascend_dualpath.bench.transfer --backend cuda "${extra[@]}" \
  --json "$OUT/transfer_cuda_1gpu.json" --plot "$OUT/transfer_cuda_1gpu.png" 2>&1 | tee "$OUT/bench_1gpu.txt"

if [[ "$(nvidia-smi -L | wc -l)" -ge 2 ]]; then
  python3 -m ascend_dualpath.bench.transfer --backend cuda "${extra[@]}" \
    --json "$OUT/transfer_cuda_2gpu.json" --plot "$OUT/transfer_cuda_2gpu.png" 2>&1 | tee "$OUT/bench_2gpu.txt"
fi
