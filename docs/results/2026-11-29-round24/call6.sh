# Call 6 (2x H200): the whole-model training step (Llama-3-8B, 4 layers, optimizer step) at TP=2 with the shipped
# policy, then the parallel Llama's GPU test with fused variants forced (call 5's run of it was cut by its limit).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
bash scripts/gpu_ship.sh 2 0,1 shipped,train_model
cp /tmp/ship-w2/bench-train_model.json "$OUT/call6-train_model.json"; cp /tmp/ship-w2/train_model.log "$OUT/call6-train_model.log"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_TEST_WORLD=2
timeout -k 10 140 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nn.py -k "gpu_llama and fused" \
  > "$OUT/call6-gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/call6-gpu-tests.log"
