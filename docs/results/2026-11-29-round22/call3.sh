#!/usr/bin/env bash
# Round 22 call 3 (2x H200): after cf065a6 (a fused projection's parts split once in eager training): the training
# layer TP=2 (70B, 8B) against torchtitan-laid-out torch TP / async TP, the 70B T=8192 step's kernels per contender
# (eager), and the whole-model step (Llama-3-8B, 4 layers, AdamW) TP=2 against the same baselines (issue 44).
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 shipped > /dev/null
[ -f /tmp/ship-w2/policy-graph.json ] || { mkdir -p /tmp/ship-w2;
  cp models/nvidia-h200-x2-3de2364861f4a5a9-graph.json /tmp/ship-w2/policy-graph.json; }
TAIL=9 bash scripts/gpu_ship.sh 2 0,1 train
cp /tmp/ship-w2/train.log "$OUT/call3-train.log"; cp /tmp/ship-w2/bench-train_layer.json "$OUT/call3-bench-train_layer.json"
cp /tmp/ship-w2/machine.txt "$OUT/call3-machine.txt"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning XDG_CACHE_HOME=/tmp/ship-w2/cache
AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json timeout -k 10 120 python3 scripts/profile_train_layer_gpu.py --world 2 \
  --model 70b --tokens 8192 --contenders autofuse,torch-tp --out "$OUT/call3-profile.json" > "$OUT/call3-profile.log" 2>&1
echo "profile rc=$?"; grep -v -E "USDT|Warning|warn_once" "$OUT/call3-profile.log" | head -4
TAIL=14 bash scripts/gpu_ship.sh 2 0,1 train_model
cp /tmp/ship-w2/train_model.log "$OUT/call3-train_model.log"
cp /tmp/ship-w2/bench-train_model.json "$OUT/call3-bench-train_model.json" 2>/dev/null
