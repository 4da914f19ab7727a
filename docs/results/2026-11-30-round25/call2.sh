# Call 2 (2x H200): mm_ring's fault scenarios on the GPUs; then the shipped 2-GPU policy (re-fitted in call 1, now in
# models/) through the held-out dispatch evaluation and the Llama-3-70B TP=2 layer bench (graph mode).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
PYTHONPATH=/tmp/site timeout 150 python3 scripts/gpu_variant_cases.py gemm_rs mm_ring --faults '{"CHUNKS": 2}' > "$OUT/call2-ring-faults.log" 2>&1
echo "ring faults rc=$?"; tail -2 "$OUT/call2-ring-faults.log"
rm -rf /tmp/ship-w2
TAIL=25 bash scripts/gpu_ship.sh 2 0,1 shipped,eval,layer
