#!/usr/bin/env bash
# Call A: re-tune the ops whose code changed this round (ag_gemm, gemm_ar: default sweep; ag_gemm's training
# problems), merge into the shipped database of this machine kind, fit both modes, the held-out evaluation.
# H100 also gets its first MoE and training (gemm_rs) rows.
source gpu_in/common.sh
[ -n "$BASE" ] || { echo "no shipped database for $GPU"; exit 1; }
[ -z "$ONLY" ] || [ "$KIND" = "$ONLY" ] || { echo "not $ONLY: stop"; exit 0; }
if [ "$KIND" = h100x2 ]; then
  export TUNE_OPS=ag_gemm,gemm_ar TUNE_MINUTES=1.3 TRAIN_OPS=ag_gemm,gemm_rs TRAIN_MINUTES=2.0 MOE_MINUTES=1.5
  STEPS=tune,tune-train,tune-moe,merge,fit,eval
else
  export TUNE_OPS=ag_gemm,gemm_ar TUNE_MINUTES=1.3 TRAIN_OPS=ag_gemm TRAIN_MINUTES=1.5
  STEPS=tune,tune-train,merge,fit,eval
fi
BASE_DB=$BASE TAIL=6 bash scripts/gpu_ship.sh 2 0,1 $STEPS 2>&1 | grep -v "^\s*$"
export PYTHONPATH=/tmp/site
timeout 60 python3 -m autofuse show --db /tmp/ship-w2/merged.db --mode graph > /tmp/ship-w2/show-graph.txt 2>&1
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
cp /tmp/ship-w2/merged.db $OUT/$KIND.db
cp /tmp/ship-w2/policy-graph.json /tmp/ship-w2/policy-eager.json $OUT/
echo "=== eval"; python3 -c "
import json
d = json.load(open('/tmp/ship-w2/eval-graph.json'))
for k, v in d['summary'].items(): print(k, v)"
