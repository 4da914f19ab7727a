#!/usr/bin/env bash
# Round 15 call 2 (4 GPUs): with call 1's policy: the MoE pair's GPU tests at 4 ranks (hybrid and fused: graph
# replay, late peer), bench moe at EP=4 (with the heap all-to-all alone vs NCCL), the training layer at TP=4.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
W=/tmp/ship-w4
if [ ! -f $W/policy-graph.json ]; then mkdir -p $W && tar xzf gpu_in/ship-w4.tgz -C $W; fi
ls $W/policy-graph.json || exit 1
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
echo "=== fused+hybrid gpu tests, 4 ranks ($(date -u +%T))"
PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1,2,3 AUTOFUSE_ONLINE_DB=/tmp/online.db AUTOFUSE_TEST_WORLD=4 timeout 200 \
  python3 -m pytest -q -m gpu tests/test_moe_fused.py tests/test_moe_hybrid.py > $OUT/moe-tests-w4.log 2>&1
echo "rc=$?"; tail -3 $OUT/moe-tests-w4.log
rm -f $W/summary.txt
TAIL=30 bash scripts/gpu_ship.sh 4 0,1,2,3 moe-bench,train 2>&1 | grep -v "^\s*$"
echo "=== done ($(date -u +%T))"
