#!/usr/bin/env bash
# Round 22 call 2 (2x H200): torch's baselines laid out as torchtitan lays them out (PrepareModuleInput hands the
# column-parallel linears a DTensor: the backward reduce-scatters, and async TP's pass has patterns to fuse), then
# `autofuse bench train_layer` TP=2 (70B, 8B) against them with the shipped 2-GPU policy (issue 44).
set -u
OUT=${OUT:-/tmp/out}; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  PYTHONWARNINGS=ignore::FutureWarning COLUMNS=140 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/xdg-cache
timeout -k 10 150 python3 scripts/async_tp_patterns.py --world 2 --model 8b --tokens 4096 --out "$OUT/call2-patterns.json" \
  > "$OUT/call2-patterns.log" 2>&1; echo "patterns rc=$?"
grep -v USDT "$OUT/call2-patterns.log" | grep -E "graph|H200|Error|error" | head -8
bash scripts/gpu_ship.sh 2 0,1 shipped
[ -f /tmp/ship-w2/policy-graph.json ] || { mkdir -p /tmp/ship-w2;
  cp models/nvidia-h200-x2-3de2364861f4a5a9-graph.json /tmp/ship-w2/policy-graph.json; }
TAIL=30 bash scripts/gpu_ship.sh 2 0,1 train
cp /tmp/ship-w2/train.log "$OUT/call2-train.log"; cp /tmp/ship-w2/bench-train_layer.json "$OUT/call2-bench-train_layer.json"
cp /tmp/ship-w2/machine.txt "$OUT/call2-machine.txt"
