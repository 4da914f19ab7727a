#!/usr/bin/env bash
# Round 16 call 3 (2x H200): profile the MoE block vs the combine alone (scripts/moe_profile_gpu.py) at three
# decode-size problems where the op-by-op tune picks hybrid's combine and the block runs faster with fused's.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$OUT/machine.txt"
for case in "qwen3 64" "deepseek 1" "mixtral 1"; do
  set -- $case
  t0=$(date +%s)
  timeout -k 5 170 python3 scripts/moe_profile_gpu.py --world 2 --model "$1" --tokens "$2" --out "$OUT/moe-profile-$1-$2.json" \
    > "$OUT/moe-profile-$1-$2.log" 2>&1
  echo "$1 T=$2 rc=$? in $(( $(date +%s) - t0 )) s"
done
for f in "$OUT"/moe-profile-*.log; do grep -E "^(==|[a-z].*mode)" "$f"; done
