#!/usr/bin/env bash
# Round 16 call 5 (2x H200, a new lease): a second sample of the 70B layer TP=2 and the MoE bench EP=2 with the
# shipped policy (call 2's host timed hybrid-combine blocks ~100 us slow; call 4's host did not).
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 shipped,layer,moe-bench
