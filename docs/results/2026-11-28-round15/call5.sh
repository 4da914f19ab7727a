#!/usr/bin/env bash
# Round 15 call 5 (4 GPUs): moe_dispatch's new `fused` variant: its GPU tests at 4 ranks (the fused pair in a CUDA
# graph replayed over changing routings; the late peer), the MoE pair re-tuned (both digests changed), merged into
# the shipped 4x H200 table, fitted, exported, bench moe at EP=4.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
rm -rf /tmp/ship-w4
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
echo "=== fused dispatch gpu tests, 4 ranks ($(date -u +%T))"
PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1,2,3 AUTOFUSE_ONLINE_DB=/tmp/online.db AUTOFUSE_TEST_WORLD=4 timeout 150 \
  python3 -m pytest -q -m gpu tests/test_moe_fused.py -k "pair or fused_dispatch" > $OUT/fused-dispatch-tests-w4.log 2>&1
echo "rc=$?"; tail -3 $OUT/fused-dispatch-tests-w4.log
export MOE_MINUTES=1
BASE_DB=tuning_db/h200x4.db TAIL=4 bash scripts/gpu_ship.sh 4 0,1,2,3 tune-moe,merge,fit,export,moe-bench 2>&1 | grep -v "^\s*$"
echo "=== done ($(date -u +%T))"
