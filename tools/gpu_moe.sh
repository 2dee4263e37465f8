#!/usr/bin/env bash
# MoE on 2x H200 (device tool): cuda-strategy conformance over nccl, then `bench moe` (cuda vs alltoall), then the
# alltoall-over-nccl conformance with whatever time is left. Every step has its own bound so that a run cut short
# still leaves the earlier steps' results under $OUT. Run from a copy of the worktree (PYTHONPATH points at it).
# Knobs: TOTAL_S (whole script, default 225), PYTEST_S (cuda conformance, 95), BENCH_S (bench, 100),
# NUM_SMS (bench SM counts, "0,48,24,8"; 0 = bandwidth model, 8 calibrates the per-SM speed), ITERS (20).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
export PYTHONPATH="$here" OUT="${OUT:-/tmp/adp_moe_out}"
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$SECONDS
total_s=${TOTAL_S:-225}
left() { echo $(( total_s - (SECONDS - start) )); }
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"; grep -E "^torch" "$OUT/env.txt"

timeout "${PYTEST_S:-95}" python3 -m pytest -q -p no:cacheprovider -k "not alltoall" tests/moe/test_moe_cuda.py \
  > "$OUT/pytest_cuda.txt" 2>&1
echo "== pytest_cuda ($((SECONDS - start)) s)"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.txt" | tail -12
if grep -qE "[0-9]+ (failed|error)" "$OUT/pytest_cuda.txt"; then
  # Measure anyway; if an eager check failed, through Triton's own launcher (the direct path is the newest part).
  if grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.txt" | grep -qv graph_replay; then export ADP_MOE_DIRECT_LAUNCH=0; fi
  grep -A30 "^____" "$OUT/pytest_cuda.txt" | head -80
elif ! grep -qE "[0-9]+ passed" "$OUT/pytest_cuda.txt"; then
  echo "cuda conformance did not finish within ${PYTEST_S:-95} s"; tail -5 "$OUT/pytest_cuda.txt"
fi
echo "ADP_MOE_FUSED=${ADP_MOE_FUSED:-1} ADP_MOE_DIRECT_LAUNCH=${ADP_MOE_DIRECT_LAUNCH:-1}"

bench_s=${BENCH_S:-100}
if [ "$(left)" -lt "$bench_s" ]; then bench_s=$(left); fi
ADP_TIMEOUT_S=10 timeout "$bench_s" python3 -m ascend_dualpath.bench.moe --strategies cuda,alltoall \
  --num-sms "${NUM_SMS:-0,48,24,8}" --iters "${ITERS:-20}" --warmup 3 --deadline-s $((bench_s - 8)) \
  --json "$OUT/bench_moe.json" > "$OUT/bench_moe.txt" 2>&1
echo "== bench ($((SECONDS - start)) s)"; grep -vE "^\s*(File|warnings|  )" "$OUT/bench_moe.txt" | tail -45

if [ "$(left)" -gt 30 ]; then
  timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -k "alltoall" tests/moe/test_moe_cuda.py \
    > "$OUT/pytest_alltoall.txt" 2>&1
  echo "== pytest_alltoall ($((SECONDS - start)) s)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_alltoall.txt" | tail -6
else
  echo "== pytest_alltoall skipped: $(left) s left"
fi
