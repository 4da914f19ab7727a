#!/usr/bin/env bash
# Round 15 call 1 (4 GPUs): gemm_ar (stale since round 13) and the MoE pair (stale since round 14) re-tuned at 4 GPUs,
# merged into the shipped 4x H200 table, fitted, exported; the held-out evaluation and the 70B layer at TP=4.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
rm -rf /tmp/ship-w4
case "$GPU" in *H100*) B4=tuning_db/h100x4.db; K4=h100x4 ;; *) B4=tuning_db/h200x4.db; K4=h200x4 ;; esac
[ -f "$B4" ] || B4=""
export TUNE_OPS=gemm_ar TUNE_MINUTES=1.5 MOE_MINUTES=1.5
if [ -n "$B4" ]; then STEPS=tune,tune-moe,merge,fit,export,eval,layer
else unset TUNE_OPS; export TUNE_MINUTES=3; STEPS=tune,tune-moe,fit,export,eval; fi
BASE_DB=$B4 TAIL=5 bash scripts/gpu_ship.sh 4 0,1,2,3 $STEPS 2>&1 | grep -v "^\s*$"
echo "=== done ($(date -u +%T)) kind $K4"
