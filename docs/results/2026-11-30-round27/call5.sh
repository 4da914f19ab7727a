# Call 5 (2x H200): why compiled autofuse trails async TP on the host-bound 8B layer (T=2048, 4096): the shipped policy
# against every op forced to BSP through the same custom ops (AUTOFUSE_VARIANT='*:bsp'), async TP beside each.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 CUDA_VISIBLE_DEVICES=0,1 COLUMNS=140
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || echo "install failed"
export PYTHONPATH=/tmp/site AUTOFUSE_POLICY=models/nvidia-h200-x2-3de2364861f4a5a9-graph.json
for run in policy bsp; do
  [ $run = bsp ] && export AUTOFUSE_VARIANT='*:bsp'
  timeout 110 python3 -m autofuse bench train_layer --world 2 --sweep 8b --shapes 2048,4096 --reps 5 \
    --variants autofuse-compiled,torch-async-tp --out "$OUT/call5-train-$run.json" --force > "$OUT/call5-train-$run.log" 2>&1
  echo "$run rc=$?"; tail -6 "$OUT/call5-train-$run.log"
done
