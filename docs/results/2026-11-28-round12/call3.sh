#!/usr/bin/env bash
# Call 3. H100: re-tune the stale ops of the 2x H100 table (call 1's H100 branch). H200: the GPU autograd tests
# (every variant's gradients, the kept gathered A) through the Library-defined custom ops.
source gpu_in/common.sh
if [ "$KIND" = h100x2 ]; then exec bash gpu_in/call1.sh; fi
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_TEST_WORLD=2
timeout 240 python3 -m pytest -q -m gpu tests/test_autograd.py -k "gathered or gradients_every" > $OUT/gpu-autograd.log 2>&1
echo "autograd gpu rc=$?"; tail -3 $OUT/gpu-autograd.log
