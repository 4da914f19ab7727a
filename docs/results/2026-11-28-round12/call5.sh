#!/usr/bin/env bash
# Call 5 (4 GPUs, the last device minutes): train_layer 8B, compiled autofuse vs torch async TP, TP=4, shipped 4-GPU policy.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1,2,3 AUTOFUSE_ONLINE_DB=/tmp/online.db PYTHONUNBUFFERED=1 COLUMNS=140
AUTOFUSE_POLICY=models/nvidia-h200-x4-71bf09d2847b4321-graph.json timeout 150 python3 -m autofuse bench train_layer --world 4 \
  --sweep 8b --variants autofuse-compiled,torch-async-tp --reps 5 --out $OUT/train4.json --force > $OUT/train4.log 2>&1
echo "rc=$?"; grep "us (diff" $OUT/train4.log
