#!/usr/bin/env bash
# Round 20, call 6 (one GPU): DeepSeek-V2 at DeepSeek-V2-Lite's layer sizes (latent attention, tensor-parallel
# experts with shared experts) on CUDA ranks sharing the GPU, then test_nn's GPU test (DeepSeek-V3 among FAMILIES).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
AUTOFUSE_RANKS_PER_GPU=4 timeout 240 python3 scripts/moe_tp_gpu.py --world 2,4 --family deepseek_v2 > "$OUT/call6-deepseek-v2.txt" 2>&1
echo "rc=$?" >> "$OUT/call6-deepseek-v2.txt"
grep -v "RoPE\|Warning\|warn\|o_proj" "$OUT/call6-deepseek-v2.txt" | tail -7
for w in 2 4; do
  AUTOFUSE_RANKS_PER_GPU=$w AUTOFUSE_TEST_WORLD=$w AUTOFUSE_HEAP_SIZE=1G timeout 150 python3 -m pytest -m gpu tests/test_nn.py -p no:cacheprovider -q -rs -W ignore > "$OUT/call6-pytest-nn-w$w.txt" 2>&1
  echo "test_nn w=$w rc=$?"; tail -1 "$OUT/call6-pytest-nn-w$w.txt"
done
