#!/usr/bin/env bash
# Round 16 call 4 (2x H200): the MoE block and combine alone timed with ~4 calls per replayed graph (the bench's
# and the tuner's batches of ~2 ms) and with ~40 ms batches: is the hybrid combine's in-block excess a per-replay
# cost (thinning out with more calls a replay) or a per-call one?
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$OUT/machine.txt"
for case in "qwen3 64" "deepseek 1"; do
  set -- $case
  t0=$(date +%s)
  timeout -k 5 200 python3 scripts/moe_profile_gpu.py --world 2 --model "$1" --tokens "$2" --long-batch-us 40000 \
    --out "$OUT/moe-batches-$1-$2.json" > "$OUT/moe-batches-$1-$2.log" 2>&1
  echo "$1 T=$2 rc=$? in $(( $(date +%s) - t0 )) s"
done
for f in "$OUT"/moe-batches-*.log; do grep -E "^(==|[a-z].*mode)" "$f"; done
