# Call 3 (2x H200): mm_ring alone vs in turns (scripts/diag_ring_gpu.py), graph and eager.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
PYTHONPATH=/tmp/site timeout 300 python3 scripts/diag_ring_gpu.py --out "$OUT/call3-diag-ring.json" 2>&1 | tee "$OUT/call3-diag-ring.log" | tail -60
