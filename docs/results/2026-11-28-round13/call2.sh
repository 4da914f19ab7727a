#!/usr/bin/env bash
# Round 13 call 2 (2 GPUs): gemm_ar re-tuned with mm_ll (its digest changed), merged into the shipped
# database, fitted, held-out evaluation; then the all-reduce latency table.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
export TUNE_OPS=gemm_ar TUNE_MINUTES=1.5
BASE_DB=$BASE TAIL=6 bash scripts/gpu_ship.sh 2 0,1 tune,merge,fit,eval 2>&1 | grep -v "^\s*$"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
timeout 60 python3 -m autofuse show --db /tmp/ship-w2/merged.db --mode graph > /tmp/ship-w2/show-graph.txt 2>&1
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
cp /tmp/ship-w2/merged.db $OUT/$KIND.db; cp /tmp/ship-w2/policy-graph.json /tmp/ship-w2/policy-eager.json $OUT/
python3 -c "
import json
d = json.load(open('/tmp/ship-w2/eval-graph.json'))
for k, v in d['summary'].items(): print(k, v)"
echo "=== ar latency ($(date -u +%T))"
AUTOFUSE_ONLINE_DB=/tmp/online-ar.db timeout 150 python3 scripts/ar_latency_gpu.py --world 2 --out $OUT/ar-latency.json > $OUT/ar-latency.log 2>&1
echo "rc=$?"; tail -9 $OUT/ar-latency.log
echo "=== done ($(date -u +%T))"
