#!/usr/bin/env bash
# Round 13 call 1 (2 GPUs): the low-latency all-reduce (mm_ll) on GPUs: its GPU tests (graph replay, faults),
# all-reduce latency by size against NCCL and torch's symmetric-memory all-reduces, gemm_ar's decode sweep
# at default configs (own vs alt), then the first-use confirmation experiment of round 12.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $OUT/machine.txt
echo "=== gpu tests ($(date -u +%T))"
timeout 240 python3 -m pytest -m gpu -q -x tests/test_lowlatency.py > $OUT/gpu-tests.log 2>&1
echo "rc=$?"; tail -4 $OUT/gpu-tests.log
echo "=== ar latency ($(date -u +%T))"
timeout 200 python3 scripts/ar_latency_gpu.py --world 2 --out $OUT/ar-latency.json > $OUT/ar-latency.log 2>&1
echo "rc=$?"; tail -9 $OUT/ar-latency.log
echo "=== bench gemm_ar default sweep ($(date -u +%T))"
timeout 240 python3 -m autofuse bench gemm_ar --sweep default --mode graph --world 2 --quiet --force \
  --variants bsp,torch_symm_one_shot,torch_symm_two_shot,mm_heap,mm_ll --out $OUT/bench-gemm_ar.json > $OUT/bench-gemm_ar.log 2>&1
echo "rc=$?"; tail -22 $OUT/bench-gemm_ar.log
echo "=== first-use confirmation vs evaluation ($(date -u +%T))"
timeout 150 python3 scripts/confirm_noise_gpu.py --world 2 --policy models/nvidia-h200-x2-3de2364861f4a5a9-graph.json \
  --out $OUT/first-use.json > $OUT/first-use.log 2>&1
echo "rc=$?"; tail -14 $OUT/first-use.log
echo "=== done ($(date -u +%T))"
