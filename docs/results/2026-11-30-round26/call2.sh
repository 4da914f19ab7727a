# Call 2 (2x H200, superseded by call 3: hybrid.py had changed, which staled ag_gemm and gemm_ar): mm_ring issuing each step's pulls, GEMMs and flags in one block per stream: its GPU cases
# (eager + CUDA-graph replay) and fault scenarios; then gemm_rs re-tuned on the shipped 2-GPU table (--sweep stored,
# gemm_rs only: the only op whose code changed), fitted, exported.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; } > "$OUT/call2-machine.txt" 2>&1
PYTHONPATH=/tmp/site timeout 200 python3 scripts/gpu_variant_cases.py gemm_rs mm_ring --faults '{"CHUNKS": 2}' > "$OUT/call2-ring-cases.log" 2>&1
echo "ring cases rc=$?"; tail -2 "$OUT/call2-ring-cases.log"
TUNE_OPS=gemm_rs TUNE_MINUTES=3.5 BASE_DB=tuning_db/h200x2.db TAIL=3 bash scripts/gpu_ship.sh 2 0,1 retune,fit,export
grep -A40 "gemm_rs bfloat16 w2" /tmp/ship-w2/show-graph.txt | head -60
