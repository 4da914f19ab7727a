# Call 7 (2x H200): scripts/diag_ring_profile.py: mm_ring (CHUNKS=4, M=6144 N=4096 K=14336) captured 10 times,
# each capture timed and profiled: do the pulls overlap the GEMMs in every capture?
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
PYTHONPATH=/tmp/site timeout 150 python3 scripts/diag_ring_profile.py --out "$OUT/call7-diag-ring-profile.json" \
  > "$OUT/call7-diag-ring-profile.log" 2>&1
echo "rc=$?"; grep -v "^USDT\|STAGE:\|warn" "$OUT/call7-diag-ring-profile.log" | tail -30
