#!/usr/bin/env bash
# Round 22 call 1 (2x H200): the tuner with sampled trials asked ahead (c467e2f) as a new user runs it, a default
# `autofuse tune` of every op at 2 GPUs (issue 43: <= 5 minutes; trials/s and the GPUs' timing share), then where a
# training step's GPU time goes, per contender, 70B layer TP=2 T=8192 (issue 44: eager autofuse behind torch TP).
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 tune
cp /tmp/ship-w2/w2.db "$OUT/call1-w2.db" 2>/dev/null
cp /tmp/ship-w2/tune.log "$OUT/call1-tune.log" 2>/dev/null
cp /tmp/ship-w2/machine.txt "$OUT/call1-machine.txt" 2>/dev/null
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning XDG_CACHE_HOME=/tmp/ship-w2/cache
left=$(( 560 - SECONDS )); [ $left -gt 60 ] || left=60
AUTOFUSE_POLICY=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json timeout -k 10 $left \
  python3 scripts/profile_train_layer_gpu.py --world 2 --model 70b --tokens 8192 --out "$OUT/call1-profile.json" \
  > "$OUT/call1-profile.log" 2>&1; echo "profile rc=$?"
grep -v USDT "$OUT/call1-profile.log" | tail -n 45
grep -E "trials|compiled ahead|timing" "$OUT/call1-tune.log" | tail -n 6
