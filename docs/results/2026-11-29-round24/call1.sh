# Call 1 (2x H200): the shipped 2-GPU policy's held-out evaluation (its JSON keeps every first-use confirmation's
# timings), then where a 70B TP=2 T=8192 training step's GPU time goes per contender, after round 23's changes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
bash scripts/gpu_ship.sh 2 0,1 shipped,eval
cp /tmp/ship-w2/eval-graph.json "$OUT/call1-eval.json"; cp /tmp/ship-w2/eval.log "$OUT/call1-eval.log"
cp /tmp/ship-w2/machine.txt "$OUT/call1-machine.txt"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 XDG_CACHE_HOME=/tmp/ship-w2/cache XDG_DATA_HOME=/tmp/ship-w2/data
AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json timeout -k 10 330 python3 scripts/profile_train_layer_gpu.py --world 2 \
  --model 70b --tokens 8192 --top 16 --out "$OUT/call1-profile.json" > "$OUT/call1-profile.log" 2>&1
echo "profile rc=$?"
grep -v Warning "$OUT/call1-profile.log" | grep -v _warn_once | head -90
