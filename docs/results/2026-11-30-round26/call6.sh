# Call 6 (2x H200): the whole-model training step (Llama-3-8B, 4 layers, AdamW) at TP=2 with the shipped policy.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
rm -rf /tmp/ship-w2
TAIL=16 bash scripts/gpu_ship.sh 2 0,1 shipped,train_model
cp /tmp/ship-w2/bench-train_model.json "$OUT/call6-train_model.json"; cp /tmp/ship-w2/train_model.log "$OUT/call6-train_model.log"
