#!/usr/bin/env bash
# Round 22 call 4 (2x H200): the parallel Llama's GPU tests at 2 ranks after cf065a6 (eager and compiled training
# gradients, reduce-overhead logits, generation; autofuse's choice and fused variants forced), then the training
# layer TP=2 (70B) a third time against the torchtitan-laid-out baselines (issue 44: run-to-run spread).
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_ship.sh 2 0,1 shipped > /dev/null
[ -f /tmp/ship-w2/policy-graph.json ] || { mkdir -p /tmp/ship-w2;
  cp models/nvidia-h200-x2-3de2364861f4a5a9-graph.json /tmp/ship-w2/policy-graph.json; }
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning XDG_CACHE_HOME=/tmp/ship-w2/cache
AUTOFUSE_TEST_WORLD=2 timeout -k 10 240 python3 -m pytest -q -m gpu tests/test_nn.py -p no:cacheprovider \
  > "$OUT/call4-gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -n 3 "$OUT/call4-gpu-tests.log"
AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json timeout -k 10 200 python3 -m autofuse bench train_layer --world 2 \
  --sweep 70b --reps 5 --out "$OUT/call4-bench-train_layer.json" --force > "$OUT/call4-train.log" 2>&1
echo "train rc=$?"; grep -E "^70b T=" "$OUT/call4-train.log"
