#!/usr/bin/env bash
# Round 21 call 2 (2x H200): is the copy-engine overlap's timing a property of the heap (symm vs IPC) or of each
# build? ag_gemm only, every copy-engine config built twice, symm heap, IPC heap, symm heap again.
set -u
OUT=${OUT:-/tmp/out}; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=140 PYTHONWARNINGS=ignore::FutureWarning CUDA_VISIBLE_DEVICES=0,1
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/xdg-cache
nvidia-smi --query-gpu=index,name --format=csv > "$OUT/call2-machine.txt" 2>&1; date -u >> "$OUT/call2-machine.txt"
for run in symm1 ipc symm2; do
  prov=""; [ $run = ipc ] && prov=torch
  AUTOFUSE_HEAP_PROVIDER=$prov timeout -k 10 240 python3 scripts/ce_probe_gpu.py --world 2 --ops ag_gemm --builds 2 \
    --db tuning_db/h200x2.db --out "$OUT/call2-ce-$run.json" > "$OUT/call2-ce-$run.log" 2>&1; echo "$run rc=$?"
done
python3 - <<'PY'
import json, os, collections
out = os.environ["OUT"]
runs = {r: json.load(open(f"{out}/call2-ce-{r}.json")) for r in ("symm1", "ipc", "symm2") if os.path.exists(f"{out}/call2-ce-{r}.json")}
print(f"{'problem':40s} " + " ".join(f"{r:>34s}" for r in runs))
keys = [row["problem"] for row in next(iter(runs.values()))]
for i, key in enumerate(keys):
    cells = []
    for r, rows in runs.items():
        t = {x["variant"] + ("/ce" + str(x["config"].get("COMM_SMS")) + x["config"].get("FLAG", "")[:1] if x["config"].get("ENGINE") == "ce" else ""): [] for x in rows[i]["timed"]}
        for x in rows[i]["timed"]:
            k = x["variant"] + ("/ce" + str(x["config"].get("COMM_SMS")) + x["config"].get("FLAG", "")[:1] if x["config"].get("ENGINE") == "ce" else "")
            t[k].append(x["us"] or 0)
        sym = t.get("torch_symm", [0])[0]
        ce = t.get("heap_mm_overlap/ce1s", [])
        cells.append(f"symm {sym:6.1f} ce1s {'/'.join(f'{v:.0f}' for v in ce):>11s} best-sm {min((x['us'] or 9e9) for x in rows[i]['timed'] if x['table_best'] or x['variant']=='bsp'):6.0f}")
    print(f"{key[8:48]:40s} " + " | ".join(cells))
PY
