#!/usr/bin/env bash
# Round 20, call 3 (one GPU): Llama 4 at Llama-4-Scout's layer sizes through parallelize on CUDA ranks sharing it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
AUTOFUSE_RANKS_PER_GPU=4 timeout 420 python3 scripts/moe_tp_gpu.py --world ${WORLDS:-2,4} --layers 1 --family llama4_text > "$OUT/call3-llama4.txt" 2>&1
echo "rc=$?" >> "$OUT/call3-llama4.txt"
grep -v "RoPE\|Warning\|warn\|o_proj" "$OUT/call3-llama4.txt" | tail -8
