#!/usr/bin/env bash
# Round 16 call 2 (2x H200): the shipped 2-GPU policy (re-tuned MoE, call 1) as dispatch finds it, then the held-out
# dispatch evaluation, the 70B layer TP=2, the MoE bench EP=2, and the training layer TP=2 (70B, 8B), graph mode.
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 shipped
[ -f /tmp/ship-w2/policy-graph.json ] || { echo "no shipped policy found: using the file"; mkdir -p /tmp/ship-w2;
  cp models/nvidia-h200-x2-3de2364861f4a5a9-graph.json /tmp/ship-w2/policy-graph.json; }
bash scripts/gpu_ship.sh 2 0,1 eval,layer,moe-bench,train
