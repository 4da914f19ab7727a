#!/usr/bin/env bash
# Round 14 call 1 (2 GPUs): MoE's heap all-to-all alone vs NCCL (GB/s per GPU), and where the hybrid block's time goes.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/machine.txt
echo "=== moe a2a ($(date -u +%T))"
timeout 420 python3 scripts/moe_a2a_gpu.py --world 2 --tokens 256,4096 --out $OUT/moe-a2a.json > $OUT/moe-a2a.log 2>&1
echo "rc=$?"; grep -v '^{' $OUT/moe-a2a.log | tail -60
echo "=== done ($(date -u +%T))"
