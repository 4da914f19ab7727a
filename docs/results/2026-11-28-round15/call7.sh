#!/usr/bin/env bash
# Round 15 call 7 (4 GPUs): bench moe at EP=4 with call 5's policy (call 5's bench ran out of the 8G heap:
# five contenders' buffers at DeepSeek T=4096); AUTOFUSE_HEAP_SIZE=32G.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150 AUTOFUSE_HEAP_SIZE=32G
W=/tmp/ship-w4
if [ ! -f $W/policy-graph.json ]; then mkdir -p $W && tar xzf gpu_in/ship-w4.tgz -C $W; fi
rm -f $W/summary.txt
TAIL=45 bash scripts/gpu_ship.sh 4 0,1,2,3 moe-bench 2>&1 | grep -v "^\s*$"
echo "=== done ($(date -u +%T))"
