#!/usr/bin/env bash
# One call: an H100 pair tunes a fresh table; an H200 pair runs the checks the 4-GPU call could not.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $name"
if echo "$name" | grep -q H100; then
  MOE_MINUTES=1.5 TRAIN_MINUTES=1.5 bash scripts/gpu_ship.sh 2 0,1 tune,tune-moe,tune-train,fit 2>&1 | tail -25
else
  bash scripts/gpu_ship.sh 2 0,1 shipped,warmup 2>&1 | tail -20
  export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
  AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json timeout 100 python3 -m autofuse bench moe --world 2 --mode graph \
    --tokens 64,4096 --skew 60 --reps 20 --out $OUT/bench-moe-skew60.json --force > $OUT/bench-moe-skew60.log 2>&1
  echo "moe skew rc=$?"; tail -22 $OUT/bench-moe-skew60.log
  AUTOFUSE_TEST_WORLD=2 AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json timeout 200 python3 -m pytest -q -m gpu \
    tests/test_nn.py -k test_gpu_llama > $OUT/llama-w2.log 2>&1
  echo "llama rc=$?"; tail -5 $OUT/llama-w2.log
fi
