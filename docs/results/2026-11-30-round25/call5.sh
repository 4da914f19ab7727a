# Call 5 (2x H200): after mm_ring's size floor (232fb41), gemm_rs re-tuned again on the table call 1 shipped, fitted,
# exported; then compiled training with that policy against torch's async TP (70B and 8B layers, TP=2).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
TUNE_OPS=gemm_rs TUNE_MINUTES=3.5 BASE_DB=tuning_db/h200x2.db TAIL=3 bash scripts/gpu_ship.sh 2 0,1 retune,fit,export
export PYTHONPATH=/tmp/site AUTOFUSE_POLICY=/tmp/ship-w2/policy-graph.json
timeout 230 python3 -m autofuse bench train_layer --world 2 --sweep 70b,8b --reps 5 \
  --variants autofuse-compiled,torch-async-tp --out "$OUT/call5-train.json" --force > "$OUT/call5-train.log" 2>&1
echo "train rc=$?"; tail -12 "$OUT/call5-train.log"
grep -A34 "gemm_rs bfloat16 w2" /tmp/ship-w2/show-graph.txt | head -36
