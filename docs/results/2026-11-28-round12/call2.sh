#!/usr/bin/env bash
# Call 2. H100: as call 1 (re-tune the stale ops of the 2x H100 table). H200, with the shipped 2x H200 table: the
# training step's host cost per call with the Library-defined custom ops; train_layer (compiled autofuse vs torch
# async TP) dispatching with the graph policy and with the eager one; the held-out eval with the second
# confirmation pass.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=140
if [ "$KIND" = h100x2 ]; then exec bash gpu_in/call1.sh; fi
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
G=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json; E=models/nvidia-h200-x2-3de2364861f4a5a9-eager.json
echo "=== host profile, train 8b T=2048 ($(date -u +%T))"
AUTOFUSE_POLICY=$G timeout 150 python3 scripts/host_profile_train.py --model 8b --tokens 2048 --variant '' \
  --out $OUT/host-train.json > $OUT/host-train.log 2>&1
echo "rc=$?"; grep -A10 "^op " $OUT/host-train.log | head -11
for m in graph:$G eager:$E; do
  echo "=== train_layer policy ${m%%:*} ($(date -u +%T))"
  AUTOFUSE_MODE=${m%%:*} AUTOFUSE_POLICY=${m#*:} AUTOFUSE_ONLINE_DB=/tmp/online-${m%%:*}.db timeout 200 python3 -m autofuse \
    bench train_layer --world 2 --sweep 8b,70b --variants autofuse-compiled,torch-async-tp --reps 5 \
    --out $OUT/train-${m%%:*}.json --force > $OUT/train-${m%%:*}.log 2>&1
  echo "rc=$?"; grep -B2 -A12 "compiled" $OUT/train-${m%%:*}.log | grep "│" | head -14
done
echo "=== eval held-out graph ($(date -u +%T))"
timeout 200 python3 scripts/eval_dispatch_gpu.py --policy $G --mode graph --world 2 --out $OUT/eval-graph.json > $OUT/eval.log 2>&1
echo "rc=$?"; python3 -c "
import json
d = json.load(open('$OUT/eval-graph.json'))
print('all', d['summary']['all'])
for r in d['rows']:
    best = min(r['us'].values()); print(round(r['pick_us'] / best, 3), r['pick'], r['problem'], r['reason'][:160])"
