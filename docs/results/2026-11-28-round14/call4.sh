#!/usr/bin/env bash
# Round 14 call 4 (2 GPUs): moe_combine's new `fused` variant: its GPU tests (graph replay, late peer), bench moe
# at default configs (bsp, hybrid, fused), then moe_combine re-tuned (its digest changed), merged into the shipped
# 2x H200 table, fitted, exported, and bench moe with that policy.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
rm -rf /tmp/ship-w2
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
echo "=== fused gpu tests ($(date -u +%T))"
AUTOFUSE_TEST_WORLD=2 timeout 200 python3 -m pytest -q -m gpu tests/test_moe_fused.py > $OUT/fused-tests.log 2>&1
echo "rc=$?"; tail -3 $OUT/fused-tests.log
echo "=== bench moe, default configs ($(date -u +%T))"
timeout 240 python3 -m autofuse bench moe --world 2 --mode graph --tokens 1,64,1024,4096 --variants bsp,hybrid,fused --reps 10 \
  --out $OUT/bench-moe-defaults.json --force > $OUT/bench-moe-defaults.log 2>&1
echo "rc=$?"; grep -E "graph:|WRONG|refused" $OUT/bench-moe-defaults.log | head -20
unset AUTOFUSE_ONLINE_DB
export MOE_OPS=moe_combine MOE_MINUTES=2
BASE_DB=tuning_db/h200x2.db TAIL=4 bash scripts/gpu_ship.sh 2 0,1 tune-moe,merge,fit,export,moe-bench 2>&1 | grep -v "^\s*$"
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
echo "=== done ($(date -u +%T))"
