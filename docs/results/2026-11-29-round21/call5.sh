#!/usr/bin/env bash
# Round 21 call 5 (2x H200): A/B of the 2-GPU graph policy on one host: before call 3's deeper tune (round 16's,
# old-policy-graph.json) and after (models/, re-fitted): the held-out dispatch evaluation with each, then the 70B
# training layer TP=2 with each (new first). old-policy-graph.json was written on the CPU host before the call
# (`git show f1b67af:models/nvidia-h200-x2-3de2364861f4a5a9-graph.json`) and removed after it.
set -u
OUT=${OUT:-/tmp/out}; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=140 PYTHONWARNINGS=ignore::FutureWarning CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site
R=docs/results/2026-11-29-round21
NEW=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json OLD=$R/old-policy-graph.json
date -u > "$OUT/call5-machine.txt"; nvidia-smi --query-gpu=index,name --format=csv >> "$OUT/call5-machine.txt"
for which in old new; do
  P=$OLD; [ $which = new ] && P=$NEW
  XDG_CACHE_HOME=/tmp/c-$which XDG_DATA_HOME=/tmp/d-$which AUTOFUSE_ONLINE_DB=/tmp/online-$which.db timeout -k 10 150 \
    python3 scripts/eval_dispatch_gpu.py --policy "$P" --mode graph --world 2 --out "$OUT/call5-eval-$which.json" > "$OUT/call5-eval-$which.log" 2>&1
  echo "eval $which rc=$?"; tail -n 8 "$OUT/call5-eval-$which.log"
done
for which in new old; do
  P=$OLD; [ $which = new ] && P=$NEW
  XDG_DATA_HOME=/tmp/d-$which AUTOFUSE_ONLINE_DB=/tmp/online-t-$which.db AUTOFUSE_POLICY=$P timeout -k 10 150 python3 -m autofuse bench train_layer \
    --world 2 --sweep 70b --reps 5 --out "$OUT/call5-train-$which.json" --force > "$OUT/call5-train-$which.log" 2>&1
  echo "train $which rc=$?"; grep "^70b T=" "$OUT/call5-train-$which.log"
done
