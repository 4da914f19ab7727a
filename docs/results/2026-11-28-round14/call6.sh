#!/usr/bin/env bash
# Round 14 call 6 (2 GPUs): bench moe with its new all-to-all-alone table, shipped policy (call 5's).
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=160
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online6.db
echo "=== bench moe ($(date -u +%T))"
timeout 200 python3 -m autofuse bench moe --world 2 --mode graph --tokens 1,256,4096 --reps 10 \
  --out $OUT/bench-moe.json --force > $OUT/bench-moe.log 2>&1
echo "rc=$?"; grep -A14 "all-to-all alone" $OUT/bench-moe.log; grep -E "geomean|WRONG|differ" $OUT/bench-moe.log
echo "=== done ($(date -u +%T))"
