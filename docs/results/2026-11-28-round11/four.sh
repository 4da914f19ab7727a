#!/usr/bin/env bash
# 4 GPUs. 4x H200: re-tune ag_gemm and gemm_ar (default sweep; ag_gemm's train sweep) into the shipped h200x4
# database, fit, then the TP=4 training-layer bench and the held-out evaluation. 4x H100 (no table yet): the
# default tune of every op, fit, the evaluation, the layer and training benches.
source gpu_in/common.sh
case "$GPU" in
  *H200*) BASE=tuning_db/h200x4.db; KIND=h200x4
          export TUNE_OPS=ag_gemm,gemm_ar TUNE_MINUTES=1.4 TRAIN_OPS=ag_gemm TRAIN_MINUTES=1.2
          A=tune,tune-train,merge,fit; B=train,eval ;;
  *H100*) KIND=h100x4; export TUNE_MINUTES=2.6; A=tune,fit; B=eval,layer,train ;;
esac
[ "$N" -ge 4 ] || { echo "fewer than 4 GPUs"; exit 1; }
BASE_DB=$BASE TAIL=4 bash scripts/gpu_ship.sh 4 0,1,2,3 $A 2>&1 | grep -v "^\s*$"
DB=/tmp/ship-w4/w4.db; [ -f /tmp/ship-w4/merged.db ] && DB=/tmp/ship-w4/merged.db
cp $DB $OUT/$KIND.db; cp /tmp/ship-w4/policy-graph.json /tmp/ship-w4/policy-eager.json $OUT/
TAIL=4 bash scripts/gpu_ship.sh 4 0,1,2,3 $B 2>&1 | grep -v "^\s*$"
