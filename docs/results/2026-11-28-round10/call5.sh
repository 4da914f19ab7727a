#!/usr/bin/env bash
# Checks of two CPU-side fixes on GPUs (MoE first-use confirmation, the Llama GPU test's compiled call), then
# a py-spy sample of the 8B training layer (autofuse compiled vs torch async TP, T=2048).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
bash scripts/gpu_ship.sh 2 0,1 shipped 2>&1 | tail -3
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json
timeout 120 python3 -m autofuse bench moe --world 2 --mode graph --tokens 64,4096 --skew 60 --reps 20 \
  --out $OUT/bench-moe-skew60.json --force > $OUT/bench-moe-skew60.log 2>&1
echo "moe skew rc=$?"; tail -20 $OUT/bench-moe-skew60.log
AUTOFUSE_TEST_WORLD=2 timeout 200 python3 -m pytest -q -m gpu tests/test_nn.py -k test_gpu_llama > $OUT/llama-w2.log 2>&1
echo "llama rc=$?"; tail -4 $OUT/llama-w2.log
pip install -q --no-index --find-links .whl py-spy > /dev/null 2>&1
timeout 150 py-spy record --subprocesses --nonblocking -r 250 --format raw -o $OUT/train8b.raw -- python3 -m autofuse bench \
  train_layer --world 2 --sweep 8b --shapes 2048 --variants autofuse-compiled,torch-async-tp --reps 30 \
  --out $OUT/train8b.json --force > $OUT/train8b.log 2>&1
echo "py-spy rc=$?"; tail -8 $OUT/train8b.log
