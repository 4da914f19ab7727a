#!/usr/bin/env bash
# Round 21 call 4 (2x H200): the shipped 2-GPU policy re-fitted with call 3's deeper tune merged in, as dispatch finds
# it by fingerprint, then the held-out dispatch evaluation, the 70B layer TP=2 and the training layer TP=2 (70B, 8B),
# graph mode.
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 shipped
[ -f /tmp/ship-w2/policy-graph.json ] || { echo "no shipped policy found: using the file"; mkdir -p /tmp/ship-w2;
  cp models/nvidia-h200-x2-3de2364861f4a5a9-graph.json /tmp/ship-w2/policy-graph.json; }
bash scripts/gpu_ship.sh 2 0,1 eval,layer,train
cat /tmp/ship-w2/summary.txt
