#!/usr/bin/env bash
# Round 15 call 3 (4 GPUs): the whole Llama-3-8B 4-layer training step at TP=4 with call 1's policy vs torch TP
# + compile + async TP.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
W=/tmp/ship-w4
if [ ! -f $W/policy-graph.json ]; then mkdir -p $W && tar xzf gpu_in/ship-w4.tgz -C $W; fi
rm -f $W/summary.txt
TAIL=30 bash scripts/gpu_ship.sh 4 0,1,2,3 train_model 2>&1 | grep -v "^\s*$"
echo "=== done ($(date -u +%T))"
