#!/usr/bin/env bash
# Whole-model training steps (Llama-3-8B config, 4 layers, AdamW, bf16, TP=2) with this round's 2x H200 policy.
source gpu_in/common.sh
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 PYTHONUNBUFFERED=1 COLUMNS=140
AUTOFUSE_POLICY=gpu_in/h200x2-policy-graph.json timeout 400 python3 -m autofuse bench train_model --world 2 --sweep 8b \
  --layers 4 --reps 5 --out $OUT/bench-train_model.json --force > $OUT/train_model.log 2>&1
echo "train_model rc=$?"; tail -14 $OUT/train_model.log
