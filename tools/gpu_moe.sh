#!/usr/bin/env bash
# MoE on 2x H200 (device tool): cuda-strategy conformance tests over nccl, then `bench moe` (cuda vs alltoall).
# Run from a copy of the worktree (PYTHONPATH points at it); writes full results under $OUT.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
export PYTHONPATH="$here" OUT="${OUT:-/tmp/adp_moe_out}"
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
cuda_conformance() {
  timeout "${PYTEST_S:-170}" python3 -m pytest -q -p no:cacheprovider -k "not alltoall" tests/moe/test_moe_cuda.py \
    > "$OUT/pytest_cuda$1.txt" 2>&1
}
cuda_conformance ""
if ! grep -qE "^[0-9]+ passed" "$OUT/pytest_cuda.txt" || grep -q "failed" "$OUT/pytest_cuda.txt"; then
  # Fall back to two launches per op (send, receive) for the rest of the run, and record how that fares.
  export ADP_MOE_FUSED=0
  cuda_conformance "_unfused"
fi
timeout "${PYTEST_S:-170}" python3 -m pytest -q -p no:cacheprovider -k "alltoall" tests/moe/test_moe_cuda.py \
  > "$OUT/pytest_alltoall.txt" 2>&1
for f in "$OUT"/pytest_*.txt; do echo "== $(basename "$f")"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -8; done
echo "ADP_MOE_FUSED=${ADP_MOE_FUSED:-1}"
ADP_TIMEOUT_S=10 timeout "${BENCH_S:-200}" python3 -m ascend_dualpath.bench.moe --strategies cuda,alltoall \
  --num-sms "${NUM_SMS:-0,8,24,48}" --iters "${ITERS:-20}" --warmup 3 --json "$OUT/bench_moe.json" \
  > "$OUT/bench_moe.txt" 2>&1
tail -40 "$OUT/bench_moe.txt"
