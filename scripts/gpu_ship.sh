#!/usr/bin/env bash
# A round's ship run for one world size on a GPU machine: `autofuse tune` at its defaults (the budgeted
# default sweep of every op), `autofuse fit` (graph and eager), `autofuse export`, the held-out dispatch
# evaluation (scripts/eval_dispatch_gpu.py, graph mode) and `autofuse bench layer` (Llama-3-70B, graph mode,
# the fitted policy). Each step logs under /tmp/ship-wWORLD and the folder is packed into
# $OUT/ship-wWORLD.tgz after every step, so a run cut short still returns what it did.
#   bash scripts/gpu_ship.sh WORLD GPUS [STEPS]
#     WORLD  ranks (one per GPU)          GPUS  CUDA_VISIBLE_DEVICES, e.g. 0,1
#     STEPS  comma-separated among tune, retune, fit, export, eval, layer, train, train_model, warmup, moe, shipped
#            (default tune,fit,export,eval,layer); shipped: instead of tune and fit, the policies dispatch would
#            find on this machine (models/, by fingerprint) become the run's policy-{graph,eager}.json; train: `autofuse bench train_layer --sweep 70b,8b` with the fitted policy
#            train_model: `autofuse bench train_model --sweep 8b --layers 4` (whole training steps) with it
#            warmup: scripts/eval_warmup_gpu.py, first requests cold vs after `autofuse warmup` (fitted policy)
#            tune: TUNE_OPS (e.g. ag_gemm,gemm_ar: re-tune only the ops whose code changed, then merge) and
#            TUNE_MINUTES (--time-limit) narrow it
#            retune: after a code change, every problem of BASE_DB (a shipped table, copied, never changed; TUNE_OPS: of those ops) re-measured
#            into the copy, `--sweep stored`: baselines and the previous winners first (TUNE_MINUTES, default 5);
#            later steps fit and export the copy
#            tune-moe / tune-train: `autofuse tune --sweep moe` (MOE_OPS, MOE_MINUTES, default 3: one minute covered 15 of 21 problems per op at
#            4 GPUs once moe_dispatch had its fused variant) / `--sweep train` (ag_gemm,
#            gemm_rs, or TRAIN_OPS; TRAIN_MINUTES, default 3) into the run's database; merge: BASE_DB (e.g. the shipped
#            tuning_db/h200x2.db, copied, never changed) merged with the run's database, which later steps then fit
#            and export; TRAIN_SHAPES: token counts for train_model (e.g. 4096)
#            moe: the MoE pair's GPU tests (graph replay of hybrid), then `autofuse bench moe` in graph mode (moe-bench:
#            the bench alone; AUTOFUSE_HEAP_SIZE default 32G there: every contender's buffers at DeepSeek-like
#            T=4096 overflow the default 8G)
# Two runs may share a 4-GPU machine on disjoint GPUs (say so beside their timings). Installs the carried
# wheels (.whl/) and the project offline first, as scripts/gpu_session.sh does.
set -uo pipefail
WORLD=$1; GPUS=$2; STEPS=${3:-tune,fit,export,eval,layer}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=${COLUMNS:-140} PYTHONWARNINGS=ignore::FutureWarning
export CUDA_VISIBLE_DEVICES=$GPUS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT=/tmp/install-out bash scripts/gpu_session.sh --name "install-w$WORLD" sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site
W=/tmp/ship-w$WORLD; mkdir -p "$W"; DB=$W/w$WORLD.db
export XDG_DATA_HOME=$W/data XDG_CACHE_HOME=$W/cache AUTOFUSE_ONLINE_DB=$W/online.db
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; git log -1 --format='commit %H' 2>/dev/null
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  echo "CUDA_VISIBLE_DEVICES=$GPUS"; } > "$W/machine.txt" 2>&1
summary=$W/summary.txt
step() {  # step NAME LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo "=== [w$WORLD] $name ($(date -u +%H:%M:%S))"
  timeout -k 10 "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "$([ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)") w$WORLD $name in $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -n "${TAIL:-12}" "$W/$name.log"
  tar czf "$OUT/ship-w$WORLD.tgz" -C "$W" --exclude=cache --exclude=data .
  return $rc
}
for s in ${STEPS//,/ }; do
  case $s in
    tune) step tune 560 python3 -m autofuse tune --world "$WORLD" --db "$DB" ${TUNE_OPS:+--op $TUNE_OPS} \
            ${TUNE_MINUTES:+--time-limit $TUNE_MINUTES} ;;
    retune) step retune 470 bash -c "cp $BASE_DB $W/retuned.db && python3 -m autofuse tune --world $WORLD --db $W/retuned.db ${TUNE_OPS:+--op $TUNE_OPS} \
              --sweep stored --time-limit ${TUNE_MINUTES:-5}"
            DB=$W/retuned.db ;;
    tune-moe) step tune-moe 300 python3 -m autofuse tune --world "$WORLD" --db "$DB" --sweep moe \
                --op "${MOE_OPS:-moe_dispatch,moe_combine}" --time-limit "${MOE_MINUTES:-3}" ;;
    tune-train) step tune-train 300 python3 -m autofuse tune --world "$WORLD" --db "$DB" --sweep train \
                  --op "${TRAIN_OPS:-ag_gemm,gemm_rs}" --time-limit "${TRAIN_MINUTES:-3}" ;;
    merge) step merge 120 bash -c "cp $BASE_DB $W/merged.db && python3 -m autofuse merge $W/merged.db $DB"
           DB=$W/merged.db ;;
    fit) for m in graph eager; do
           step "fit-$m" 240 python3 -m autofuse fit --db "$DB" --mode "$m" --out "$W/policy-$m.json" \
             --report "$W/fit-$m.json" --force
         done ;;
    export) for m in graph eager; do
              step "export-$m" 120 bash -c "python3 -m autofuse export --db $DB --mode $m --format csv --out $W/tuning-$m.csv --force && python3 -m autofuse export --db $DB --mode $m --format json --out $W/tuning-$m.json --force && python3 -m autofuse show --db $DB --mode $m > $W/show-$m.txt"
            done ;;
    eval) step eval 420 python3 scripts/eval_dispatch_gpu.py --policy "$W/policy-graph.json" --mode graph \
            --world "$WORLD" --out "$W/eval-graph.json" ;;
    layer) step layer 420 env AUTOFUSE_POLICY="$W/policy-graph.json" python3 -m autofuse bench layer --world "$WORLD" \
             --mode graph --out "$W/bench-layer.json" --force ;;
    train) step train 560 env AUTOFUSE_POLICY="$W/policy-graph.json" python3 -m autofuse bench train_layer \
             --world "$WORLD" --sweep 70b,8b --reps 5 --out "$W/bench-train_layer.json" --force ;;
    warmup) step warmup 300 python3 scripts/eval_warmup_gpu.py --policy "$W/policy-graph.json" --mode graph \
              --world "$WORLD" --out "$W/eval-warmup.json" ;;
    train_model) step train_model 590 env AUTOFUSE_POLICY="$W/policy-graph.json" python3 -m autofuse bench \
                   train_model --world "$WORLD" --sweep 8b --layers 4 --reps 5 ${TRAIN_SHAPES:+--shapes $TRAIN_SHAPES} --out "$W/bench-train_model.json" --force ;;
    moe|moe-bench) [ "$s" = moe ] && step moe-tests 200 env AUTOFUSE_TEST_WORLD="$WORLD" python3 -m pytest -q -m gpu \
                     tests/test_moe_hybrid.py
         step moe-bench 300 env AUTOFUSE_POLICY="$W/policy-graph.json" AUTOFUSE_HEAP_SIZE="${AUTOFUSE_HEAP_SIZE:-32G}" python3 -m autofuse bench moe --world "$WORLD" --mode graph --tokens 1,64,1024,4096 \
           --reps 20 --out "$W/bench-moe.json" --force ;;
    shipped) step shipped 120 python3 -c "
import shutil, sys
from autofuse.dispatch import find_policy
from autofuse.measure.environment import fingerprint
fp = fingerprint()
for mode in ('graph', 'eager'):
    path = find_policy(fp, mode)
    if path is None:
        sys.exit(f'no shipped policy for fingerprint {fp[\"id\"]}')
    shutil.copy(path, '$W/policy-' + mode + '.json')
    print(mode, path)" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "=== [w$WORLD] summary ($(head -1 "$W/machine.txt"))"
cat "$summary"
