#!/usr/bin/env bash
# Round 21 call 1 (2x H200): the copy engine beside cuBLAS on the default (torch symmetric-memory) heap, against
# torch's fused ops and the shipped table's own best, where torch's win (scripts/ce_probe_gpu.py); then the same on
# the IPC heap. Graph mode, one rank per GPU, candidates timed in turns.
set -u
OUT=${OUT:-/tmp/out}; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=140 PYTHONWARNINGS=ignore::FutureWarning CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/xdg-cache
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m | head -4; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/call1-machine.txt" 2>&1
timeout -k 10 330 python3 scripts/ce_probe_gpu.py --world 2 --db tuning_db/h200x2.db --out "$OUT/call1-ce-symm.json" > "$OUT/call1-ce-symm.log" 2>&1; echo "symm rc=$?"
AUTOFUSE_HEAP_PROVIDER=torch timeout -k 10 200 python3 scripts/ce_probe_gpu.py --world 2 --db tuning_db/h200x2.db --out "$OUT/call1-ce-ipc.json" > "$OUT/call1-ce-ipc.log" 2>&1; echo "ipc rc=$?"
cat "$OUT/call1-machine.txt" | head -4; tail -n 70 "$OUT/call1-ce-symm.log"; tail -n 40 "$OUT/call1-ce-ipc.log"
