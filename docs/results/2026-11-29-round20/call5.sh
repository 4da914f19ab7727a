#!/usr/bin/env bash
# Round 20, call 5 (one GPU): the round's last nn code on CUDA ranks sharing the GPU: test_nn's GPU test (every
# FAMILIES model, Llama 4 included) at 2 and 4 ranks, and GPT-OSS at gpt-oss-20b's layer sizes again.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
git log --oneline -1 > "$OUT/call5-commit.txt" 2>&1
for w in 2 4; do
  AUTOFUSE_RANKS_PER_GPU=$w AUTOFUSE_TEST_WORLD=$w AUTOFUSE_HEAP_SIZE=1G timeout 200 python3 -m pytest -m gpu tests/test_nn.py -p no:cacheprovider -q -rs -W ignore > "$OUT/call5-pytest-nn-w$w.txt" 2>&1
  echo "test_nn w=$w rc=$?"; tail -1 "$OUT/call5-pytest-nn-w$w.txt"
done
AUTOFUSE_RANKS_PER_GPU=4 timeout 200 python3 scripts/moe_tp_gpu.py --world 2,4 > "$OUT/call5-gpt-oss.txt" 2>&1
echo "rc=$?" >> "$OUT/call5-gpt-oss.txt"
grep -v "RoPE\|Warning\|warn\|o_proj" "$OUT/call5-gpt-oss.txt" | tail -7
