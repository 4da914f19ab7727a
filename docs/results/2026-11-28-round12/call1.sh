#!/usr/bin/env bash
# Call 1. H100: re-tune the stale ops of the shipped 2x H100 table (ag_gemm, gemm_ar: default sweep; ag_gemm's
# training problems), merge, fit, held-out eval, 70B layer. H200: diagnostics with the shipped 2x H200 table:
# confirmation-vs-evaluation timing noise, the training step's host cost per call, the 70B layer with round 9's
# policy and with today's on one host.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=140
if [ "$KIND" = h100x2 ]; then
  export TUNE_OPS=ag_gemm,gemm_ar TUNE_MINUTES=1.3 TRAIN_OPS=ag_gemm TRAIN_MINUTES=1.5
  BASE_DB=$BASE TAIL=6 bash scripts/gpu_ship.sh 2 0,1 tune,tune-train,merge,fit,eval,layer 2>&1 | grep -v "^\s*$"
  export PYTHONPATH=/tmp/site
  timeout 60 python3 -m autofuse show --db /tmp/ship-w2/merged.db --mode graph > /tmp/ship-w2/show-graph.txt 2>&1
  tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
  cp /tmp/ship-w2/merged.db $OUT/$KIND.db; cp /tmp/ship-w2/policy-graph.json /tmp/ship-w2/policy-eager.json $OUT/
  python3 -c "
import json
d = json.load(open('/tmp/ship-w2/eval-graph.json'))
for k, v in d['summary'].items(): print(k, v)"
  exit 0
fi
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
NEW=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/machine.txt
echo "=== confirm noise ($(date -u +%T))"
timeout 200 python3 scripts/confirm_noise_gpu.py --world 2 --mode graph --out $OUT/confirm-noise.json > $OUT/confirm-noise.log 2>&1
echo "rc=$?"; tail -12 $OUT/confirm-noise.log
echo "=== host profile, train 8b T=2048 ($(date -u +%T))"
AUTOFUSE_POLICY=$NEW timeout 150 python3 scripts/host_profile_train.py --model 8b --tokens 2048 --variant '' \
  --out $OUT/host-train.json > $OUT/host-train.log 2>&1
echo "rc=$?"; tail -25 $OUT/host-train.log
for p in r9:gpu_in/r9-h200x2-policy-graph.json r11:$NEW; do
  echo "=== layer ${p%%:*} ($(date -u +%T))"
  AUTOFUSE_POLICY=${p#*:} AUTOFUSE_ONLINE_DB=/tmp/online-${p%%:*}.db timeout 130 python3 -m autofuse bench layer --world 2 \
    --mode graph --out $OUT/layer-${p%%:*}.json --force > $OUT/layer-${p%%:*}.log 2>&1
  echo "rc=$?"; tail -6 $OUT/layer-${p%%:*}.log
done
