#!/usr/bin/env bash
# Round 21 call 3 (2x H200): a deeper tune, with today's code (no op digest changed), of the 27 problems of the shipped
# 2x H200 table where autofuse's own best was below 1.03x of torch's symmetric-memory op (call3-problems.txt:
# ag_gemm 12, gemm_rs 13, gemm_ar 2). The run's database is merged into the shipped table on the CPU host.
set -u
OUT=${OUT:-/tmp/out}; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=140 PYTHONWARNINGS=ignore::FutureWarning CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/xdg-cache XDG_DATA_HOME=/tmp/xdg-data AUTOFUSE_ONLINE_DB=/tmp/online.db
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } > "$OUT/call3-machine.txt" 2>&1
args=(); while read -r k; do args+=(--shapes "$k"); done < docs/results/2026-11-29-round21/call3-problems.txt
timeout -k 15 500 python3 -m autofuse tune --world 2 --op ag_gemm,gemm_rs,gemm_ar "${args[@]}" --time-limit "${MINUTES:-6}" \
  --db "$OUT/call3-w2.db" > "$OUT/call3-tune.log" 2>&1; echo "tune rc=$?"
python3 -m autofuse show --db "$OUT/call3-w2.db" --mode graph > "$OUT/call3-show-graph.txt" 2>&1
tail -n 25 "$OUT/call3-tune.log"
