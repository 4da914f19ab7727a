#!/usr/bin/env bash
# Call B (same warm machine as call A): GPU tests of this round's code (the kept gathered A, gradients of every
# variant, the MoE pair's GPU tests incl. gradients and a late peer), then the benches with call A's policy.
source gpu_in/common.sh
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_TEST_WORLD=2
ls /tmp/ship-w2/policy-graph.json || { echo "no policy from call A"; exit 1; }
if [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_autograd.py -k "gathered or gradients_every" > $OUT/gpu-autograd.log 2>&1
  echo "autograd gpu rc=$?"; tail -3 $OUT/gpu-autograd.log
fi
STEPS=${STEPS:-moe,layer,train}
TAIL=4 bash scripts/gpu_ship.sh 2 0,1 $STEPS 2>&1 | grep -v "^\s*$"
