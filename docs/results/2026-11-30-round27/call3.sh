# Call 3 (2x H200): mm_ring as in round 26 (call 1's work buffers reverted) with the
# CHUNKS-aware floor: GPU cases (eager + CUDA-graph replay) and fault scenarios; gemm_rs re-tuned on the shipped
# 2-GPU table (--sweep stored), fitted, exported; the held-out dispatch evaluation (--repeat 3).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
rm -rf /tmp/ship-w2
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
PYTHONPATH=/tmp/site timeout 200 python3 scripts/gpu_variant_cases.py gemm_rs mm_ring --faults '{"CHUNKS": 2}' > "$OUT/call3-ring-cases.log" 2>&1
echo "ring cases rc=$?"; tail -2 "$OUT/call3-ring-cases.log"
TUNE_OPS=gemm_rs TUNE_MINUTES=3.5 BASE_DB=tuning_db/h200x2.db TAIL=3 bash scripts/gpu_ship.sh 2 0,1 retune,fit,export,eval
cp /tmp/ship-w2/machine.txt "$OUT/call3-machine.txt"
grep -A40 "gemm_rs bfloat16 w2" /tmp/ship-w2/show-graph.txt | sed -n 33,70p
