#!/usr/bin/env bash
# CUDA analogues of the transfer kinds on a GPU machine: the sweep peer to peer (cuda:0 -> cuda:1, with two
# or more GPUs), the sweep on one GPU (destination on the same GPU), then the GPU tests. Sweeps go first so
# that a session short of time still gets numbers; each step has its own time limit (seconds, 0 = none).
# A tuning step then runs the raw device kernel (--primitives) in other configurations (tile KiB : programs per
# SM : warps [: stream|nostream]) on the bandwidth and layer-block cases, on two GPUs and on one.
# Results (JSON, PNG, logs) go to $OUT (default ./gpu_transfer_out). Needs torch with CUDA and triton.
#
#   tools/gpu_transfer.sh                                   # full sweep, 10 timed requests per kind and case
#   QUICK=1 TUNE=0 tools/gpu_transfer.sh                    # three small cases, no tuning
#   SWEEP_LIMIT=150 TEST_LIMIT=60 tools/gpu_transfer.sh     # bounded steps
#   SWEEP=0 TUNE_KINDS=... TUNE_CASES=... tools/gpu_transfer.sh   # tuning step and GPU tests only
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_transfer_out}"
mkdir -p "$OUT"
extra=(--repeats "${REPEATS:-10}")
[[ "${QUICK:-0}" == 1 ]] && extra+=(--quick)
limit() { if [[ "${1:-0}" -gt 0 ]]; then echo "timeout -s INT -k 5 $1"; fi; }

{
  date -u +"date %Y-%m-%d %H:%M:%S UTC"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv
  nvidia-smi topo -m | head -4
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/hardware.txt"

if [[ "${SWEEP:-1}" == 1 ]]; then
  if [[ "$(nvidia-smi -L | wc -l)" -ge 2 ]]; then
    $(limit "${SWEEP_LIMIT:-0}") python3 -m ascend_dualpath.bench.transfer --backend cuda "${extra[@]}" \
      --json "$OUT/transfer_cuda_2gpu.json" --plot "$OUT/transfer_cuda_2gpu.png" 2>&1 | tee "$OUT/bench_2gpu.txt"
  fi
  CUDA_VISIBLE_DEVICES="${GPU0:-0}" $(limit "${SWEEP_LIMIT_1GPU:-${SWEEP_LIMIT:-0}}") \
    python3 -m ascend_dualpath.bench.transfer --backend cuda "${extra[@]}" \
    --json "$OUT/transfer_cuda_1gpu.json" --plot "$OUT/transfer_cuda_1gpu.png" 2>&1 | tee "$OUT/bench_1gpu.txt"
fi

# the size-based defaults against other grids and tiles, and wider grids for 64 MiB
TUNE_KINDS="${TUNE_KINDS:-device,device:-:-:-:nostream,device:16:8:4,device:32:8:8,device:4:32:2:stream,device:4:64:2:stream,device:4:128:2:stream,device:8:16:4:stream}"
TUNE_KINDS_2GPU="${TUNE_KINDS_2GPU:-device,device:16:8:4,device:4:64:2:stream}"
TUNE_CASES_2GPU="${TUNE_CASES_2GPU:-1x64M,61x42K layer blocks,4096x72K MLA blocks}"
TUNE_CASES="${TUNE_CASES:-1x64M,64x1M,1x1M,61x42K layer blocks,4096x4K,4096x72K MLA blocks}"
if [[ "${TUNE:-1}" == 1 ]]; then
  if [[ "$(nvidia-smi -L | wc -l)" -ge 2 ]]; then
    $(limit "${TUNE_LIMIT:-0}") python3 -m ascend_dualpath.bench.transfer --backend cuda --primitives "${extra[@]}" \
      --kinds "${TUNE_KINDS_2GPU:-$TUNE_KINDS}" --cases "${TUNE_CASES_2GPU:-$TUNE_CASES}" --json "$OUT/tune_cuda_2gpu.json" 2>&1 | tee "$OUT/tune_2gpu.txt"
  fi
  CUDA_VISIBLE_DEVICES="${GPU0:-0}" $(limit "${TUNE_LIMIT:-0}") python3 -m ascend_dualpath.bench.transfer \
    --backend cuda --primitives "${extra[@]}" --kinds "$TUNE_KINDS" --cases "$TUNE_CASES" --json "$OUT/tune_cuda_1gpu.json" \
    2>&1 | tee "$OUT/tune_1gpu.txt"
fi

$(limit "${TEST_LIMIT:-0}") python3 -m pytest -q -p no:cacheprovider -m cuda tests/transport/test_cuda.py 2>&1 | tee "$OUT/tests.txt"
