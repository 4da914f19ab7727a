#!/usr/bin/env bash
# Round 13 call 3 (2 GPUs): the Llama-3-70B TP=2 layer with the re-tuned shipped policy (gemm_ar with mm_ll).
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
OUT_SAVE=$OUT; OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online-layer.db
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/machine.txt
echo "=== layer ($(date -u +%T))"
AUTOFUSE_POLICY=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json timeout 300 python3 -m autofuse bench layer --world 2 \
  --mode graph --out $OUT/layer.json --force > $OUT/layer.log 2>&1
echo "rc=$?"; tail -8 $OUT/layer.log
echo "=== bench gemm_ar models sweep, decode sizes outside the tuned sweep ($(date -u +%T))"
AUTOFUSE_ONLINE_DB=/tmp/online-bench.db timeout 200 python3 -m autofuse bench gemm_ar --sweep models --mode graph --world 2 --quiet --force \
  --variants bsp,torch_symm_one_shot,torch_symm_two_shot,mm_heap,mm_ll --shapes 1,8 --out $OUT/bench-gemm_ar-models.json > $OUT/bench-gemm_ar-models.log 2>&1
echo "rc=$?"; grep -E "geomean|^│" $OUT/bench-gemm_ar-models.log | head -24
echo "=== done ($(date -u +%T))"
