# Call 4 (2x H200): compiled training through autofuse (the shipped 2-GPU graph policy, mm_ring in it) against
# torch's async TP (compiled), Llama-3 70B and 8B layers, TP=2, T = 2048/4096/8192.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
export PYTHONPATH=/tmp/site AUTOFUSE_POLICY=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json
timeout 520 python3 -m autofuse bench train_layer --world 2 --sweep 70b,8b --reps 5 \
  --variants autofuse-compiled,torch-async-tp --out "$OUT/call4-train.json" --force > "$OUT/call4-train.log" 2>&1
echo "train rc=$?"; tail -40 "$OUT/call4-train.log"
