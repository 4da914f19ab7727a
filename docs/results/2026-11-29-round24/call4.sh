# Call 4 (2x H200): compiled training, 70B layer TP=2, autofuse's policy against forced variant families, each
# run timing autofuse-compiled and torch's async TP in turns: is what the policy picks (measured op by op, alone)
# what wins inside a compiled step?
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT2=$OUT; OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true >/dev/null 2>&1
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 XDG_CACHE_HOME=/tmp/c4/cache XDG_DATA_HOME=/tmp/c4/data
run() {  # run NAME [AUTOFUSE_VARIANT]
  local name=$1 force=${2:-}
  AUTOFUSE_VARIANT=$force timeout -k 10 130 python3 -m autofuse bench train_layer --world 2 --sweep 70b \
    --variants autofuse-compiled,torch-async-tp --reps 5 --shapes 4096,8192 --quiet --out "$OUT2/call4-$name.json" \
    > "$OUT2/call4-$name.log" 2>&1
  echo "== $name (AUTOFUSE_VARIANT=$force) rc=$?"
  python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    u = r['us']; print(r['model'], r['tokens'], {k: round(v) for k, v in u.items()},
                       'compiled/async %.3f' % (u['torch-async-tp'] / u['autofuse-compiled']), 'ok', r['ok'])
" "$OUT2/call4-$name.json" || tail -5 "$OUT2/call4-$name.log"
}
run policy
run bsp '*:bsp'
run fused 'ag_gemm:push_ws,gemm_rs:push_last'
run hybrid 'ag_gemm:heap_mm_overlap,gemm_rs:mm_heap_overlap'
