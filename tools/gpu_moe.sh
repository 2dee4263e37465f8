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
} 2>&1 | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/moe/test_moe_cuda.py > "$OUT/pytest_cuda.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error:|error:" "$OUT/pytest_cuda.txt" | sort | uniq -c | sort -rn | head -30
timeout 280 python3 -m ascend_dualpath.bench.moe --strategies cuda,alltoall --num-sms "${NUM_SMS:-0,48}" \
  --json "$OUT/bench_moe.json" 2>&1 | tail -40 | tee "$OUT/bench_moe.txt"
