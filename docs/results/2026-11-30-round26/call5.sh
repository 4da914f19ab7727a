# Call 5 (2x H200): scripts/diag_ring_eval.py: mm_ring in the held-out evaluation's conditions (call 3: 665 us there,
# 499 us at confirmation), in turns with different candidate sets, alone, before and after a second runner.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
PYTHONPATH=/tmp/site timeout 300 python3 scripts/diag_ring_eval.py docs/results/2026-11-30-round26/call3-eval.json \
  'gemm_rs|K=14336,M=6144,N=4096|bfloat16|w2' --out "$OUT/call5-diag-ring-eval.json" > "$OUT/call5-diag-ring-eval.log" 2>&1
echo "rc=$?"; tail -30 "$OUT/call5-diag-ring-eval.log"
