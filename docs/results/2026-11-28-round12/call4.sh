#!/usr/bin/env bash
# Call 4 (2x H200, warm): host cost per call of a training step, custom ops defined with torch.library.custom_op (before
# 994f9ad) and with torch.library.Library (after), on one host, twice each, alternating.
source gpu_in/common.sh
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online-hp.db
G=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json
F=$(python3 -c "import autofuse.library.custom as c; print(c.__file__)"); cp $F /tmp/custom_new.py
for run in new1 old1 new2 old2; do
  case $run in new*) cp /tmp/custom_new.py $F ;; old*) cp gpu_in/custom_old.py (git show 994f9ad~1:autofuse/library/custom.py) $F ;; esac
  AUTOFUSE_POLICY=$G timeout 120 python3 scripts/host_profile_train.py --model 8b --tokens 2048 --variant '' \
    --out $OUT/host-$run.json > $OUT/host-$run.log 2>&1
  echo "$run rc=$? $(grep 'per layer' $OUT/host-$run.log | cut -c1-90)"
done
cp /tmp/custom_new.py $F
grep -A9 "^op " $OUT/host-old2.log; grep -A9 "^op " $OUT/host-new2.log
