#!/usr/bin/env bash
# Round 13 call 6 (2 GPUs): gemm_rs's training problems (the train sweep, few configs each so far) tuned for 2.5
# minutes into the shipped 2x H200 database, fitted; then the 70B training layer, compiled autofuse vs torch's
# async TP, with the shipped policy and with the new one, back to back on this host.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
export TRAIN_OPS=gemm_rs TRAIN_MINUTES=2.5
BASE_DB=$BASE TAIL=5 bash scripts/gpu_ship.sh 2 0,1 tune-train,merge,fit 2>&1 | grep -v "^\s*$"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
timeout 60 python3 -m autofuse show --db /tmp/ship-w2/merged.db --mode graph > /tmp/ship-w2/show-graph.txt 2>&1
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
for p in shipped:models/nvidia-h200-x2-3de2364861f4a5a9-graph.json new:/tmp/ship-w2/policy-graph.json; do
  echo "=== train_layer 70b policy ${p%%:*} ($(date -u +%T))"
  AUTOFUSE_POLICY=${p#*:} AUTOFUSE_ONLINE_DB=/tmp/online-${p%%:*}.db timeout 170 python3 -m autofuse \
    bench train_layer --world 2 --sweep 70b --variants autofuse-compiled,torch-async-tp --reps 5 \
    --out $OUT/train-${p%%:*}.json --force > $OUT/train-${p%%:*}.log 2>&1
  echo "rc=$?"; grep "│" $OUT/train-${p%%:*}.log | head -6; grep -i "geomean" $OUT/train-${p%%:*}.log | head -3
done
echo "=== done ($(date -u +%T))"
