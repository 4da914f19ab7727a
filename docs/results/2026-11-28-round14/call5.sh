#!/usr/bin/env bash
# Round 14 call 5 (2 GPUs): the fused combine with GROUP_M swizzle and 16-row tiles: its GPU tests, moe_combine
# re-tuned (compile-ahead fix exercised), merged into the shipped table, fitted, exported, bench moe.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
rm -rf /tmp/ship-w2
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
echo "=== fused gpu tests ($(date -u +%T))"
PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db AUTOFUSE_TEST_WORLD=2 timeout 200 \
  python3 -m pytest -q -m gpu tests/test_moe_fused.py > $OUT/fused-tests.log 2>&1
echo "rc=$?"; tail -3 $OUT/fused-tests.log
export MOE_OPS=moe_combine MOE_MINUTES=2
BASE_DB=tuning_db/h200x2.db TAIL=4 bash scripts/gpu_ship.sh 2 0,1 tune-moe,merge,fit,export,moe-bench 2>&1 | grep -v "^\s*$"
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
echo "=== done ($(date -u +%T))"
