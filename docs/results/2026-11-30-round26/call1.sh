# Call 1 (2x H200): mm_ring with copy-engine flag writes: its GPU cases (eager + CUDA-graph replay) and fault
# scenarios, then scripts/diag_ring_gpu.py (host cost per piece and per call; alone vs in turns, graph and eager).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
{ date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  PYTHONPATH=/tmp/site python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/call1-machine.txt" 2>&1
[ -n "${SKIP_CASES:-}" ] || PYTHONPATH=/tmp/site timeout 240 python3 scripts/gpu_variant_cases.py gemm_rs mm_ring --faults '{"CHUNKS": 2}' > "$OUT/call1-ring-cases.log" 2>&1
echo "ring cases rc=$?"; tail -6 "$OUT/call1-ring-cases.log"
PYTHONPATH=/tmp/site timeout 330 python3 scripts/diag_ring_gpu.py --out "$OUT/call1-diag-ring.json" > "$OUT/call1-diag-ring.log" 2>&1
echo "diag rc=$?"; tail -75 "$OUT/call1-diag-ring.log"
