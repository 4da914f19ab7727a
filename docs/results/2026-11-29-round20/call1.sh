#!/usr/bin/env bash
# Round 20, call 1 (one GPU): GPT-OSS at gpt-oss-20b's layer sizes through parallelize on CUDA ranks sharing it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/call1-machine.txt" 2>&1
AUTOFUSE_RANKS_PER_GPU=4 timeout 330 python3 scripts/gpt_oss_gpu.py --world 2,4 > "$OUT/call1-gpt-oss.txt" 2>&1
echo "rc=$?" >> "$OUT/call1-gpt-oss.txt"
AUTOFUSE_RANKS_PER_GPU=2 timeout 150 python3 scripts/gpt_oss_gpu.py --world 2 --family mixtral > "$OUT/call1-mixtral.txt" 2>&1
echo "rc=$?" >> "$OUT/call1-mixtral.txt"
cat "$OUT/call1-machine.txt"; grep -v "RoPE\|eos_token\|Warning\|warn" "$OUT/call1-gpt-oss.txt" | tail -8; grep -v "RoPE\|warn" "$OUT/call1-mixtral.txt" | tail -4
