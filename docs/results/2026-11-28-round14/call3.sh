#!/usr/bin/env bash
# Round 14 call 3 (2 GPUs): the MoE pair re-tuned (their digests changed: the row epilogues), merged into the
# shipped 2x H200 database, fitted, exported; bench moe with that policy (even routing, then 60% skew).
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
export MOE_MINUTES=2
BASE_DB=tuning_db/h200x2.db TAIL=5 bash scripts/gpu_ship.sh 2 0,1 tune-moe,merge,fit,export,moe-bench 2>&1 | grep -v "^\s*$"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
echo "=== bench moe skew 60 ($(date -u +%T))"
AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json XDG_CACHE_HOME=/tmp/ship-w2/cache AUTOFUSE_ONLINE_DB=/tmp/ship-w2/online.db \
  timeout 200 python3 -m autofuse bench moe --world 2 --mode graph --tokens 1,64,1024,4096 --skew 60 --reps 10 \
  --out /tmp/ship-w2/bench-moe-skew60.json --force > /tmp/ship-w2/bench-moe-skew60.log 2>&1
echo "rc=$?"; grep -E "geomean|mixtral|qwen3|deepseek" /tmp/ship-w2/bench-moe-skew60.log | head -16
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
echo "=== done ($(date -u +%T))"
