# Call 4 (2x H200): the shipped 2-GPU policy (call 3's, now in models/): `bench layer` (Llama-3-70B, TP=2, graph) and
# compiled training against torch's async TP (70B and 8B layers, TP=2).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
rm -rf /tmp/ship-w2
TAIL=14 bash scripts/gpu_ship.sh 2 0,1 shipped,layer
export PYTHONPATH=/tmp/site AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json
timeout 260 python3 -m autofuse bench train_layer --world 2 --sweep 70b,8b --reps 5 \
  --variants autofuse-compiled,torch-async-tp --out "$OUT/call4-train.json" --force > "$OUT/call4-train.log" 2>&1
echo "train rc=$?"; tail -14 "$OUT/call4-train.log"
