#!/usr/bin/env bash
# Round 13 call 5 (2 GPUs): mm_ll's GPU tests at 4 ranks on 2 GPUs (correctness, graph replay, faults; nothing
# timed), then the held-out evaluation with the shipped policy now that confirmation also times torch's ops.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
OUT_SAVE=$OUT; OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
echo "=== gpu tests, 4 ranks on 2 GPUs ($(date -u +%T))"
AUTOFUSE_RANKS_PER_GPU=2 AUTOFUSE_TEST_WORLD=4 timeout 150 python3 -m pytest -m gpu -q -x tests/test_lowlatency.py \
  > $OUT/gpu-tests-w4-on-2.log 2>&1
echo "rc=$?"; tail -3 $OUT/gpu-tests-w4-on-2.log
echo "=== eval held-out, shipped policy ($(date -u +%T))"
AUTOFUSE_ONLINE_DB=/tmp/online-eval.db timeout 200 python3 scripts/eval_dispatch_gpu.py \
  --policy models/nvidia-h200-x2-3de2364861f4a5a9-graph.json --mode graph --world 2 --out $OUT/eval-graph.json > $OUT/eval.log 2>&1
echo "rc=$?"; tail -9 $OUT/eval.log | cut -c1-160
python3 -c "
import json
d = json.load(open('$OUT/eval-graph.json'))
for r in d['rows']:
    best = min(r['us'].values()); print(round(r['pick_us'] / best, 3), r['pick'], r['problem'], 'timed:', ','.join(k.split()[0] for k in (r.get('confirm_us') or {})))"
echo "=== done ($(date -u +%T))"
