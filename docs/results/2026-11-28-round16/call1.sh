#!/usr/bin/env bash
# Round 16 call 1: the MoE pair re-tuned at 2 GPUs (0,1) then 4 GPUs (0-3), nothing else on the machine;
# then moe_dispatch fused GPU tests at 2 ranks (first at 2 GPUs). Merge/fit/export run on the CPU host afterwards.
set -u
OUT=${OUT:-/tmp/out}; export OUT
MOE_MINUTES=2.5 bash scripts/gpu_ship.sh 2 0,1 tune-moe
MOE_MINUTES=3 bash scripts/gpu_ship.sh 4 0,1,2,3 tune-moe
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_TEST_WORLD=2 timeout -k 5 125 python3 -m pytest -q -m gpu tests/test_moe_fused.py \
  > "$OUT/moe-fused-tests-w2.log" 2>&1
echo "moe-fused-tests-w2 rc=$? in $(( $(date +%s) - t0 )) s"; tail -5 "$OUT/moe-fused-tests-w2.log"
cat /tmp/ship-w2/summary.txt /tmp/ship-w4/summary.txt
