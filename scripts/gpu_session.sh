#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels and the project offline, then run the
# named stages, logging each under $OUT. Usage (from the repo root on the GPU machine):
#   bash scripts/gpu_session.sh doctor check bench:ag_gemm tune:ag_gemm ...
# Stages: doctor | check[:NAME] (scripts/gpu_check_NAME.py, default all) | bench:OP[:SWEEP]
#   | tune:OP[:TRIALS[:MINUTES]] | fit[:MODE] | eval[:MODE] (held-out dispatch quality) | dispatch (overhead)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/work; rm -rf "$W"; mkdir -p "$W"   # everything lands here, then one tarball goes to $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
date -u +"%Y-%m-%dT%H:%M:%SZ" > "$W/date.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$W/gpus.txt" 2>&1
status=0
for stage in "$@"; do
  IFS=: read -r what arg1 arg2 arg3 <<< "$stage"
  log="$W/${what}${arg1:+-$arg1}.log"
  echo "=== $stage ($(date -u +%H:%M:%S))"
  t0=$(date +%s)
  case "$what" in
    doctor) python3 -m autofuse doctor --json "$W/doctor.json" ;;
    check) for s in scripts/gpu_check_${arg1:-*}.py; do echo "--- $s"; timeout 300 python3 "$s" || status=1; done ;;
    bench) python3 -m autofuse bench "$arg1" --sweep "${arg2:-gpu}" --out "$W/bench-$arg1-${arg2:-gpu}.json" ;;
    tune) python3 -m autofuse tune --op "$arg1" --sweep gpu --db tuning_db/h200x2.db --mode graph \
            ${arg2:+--trials $arg2} ${arg3:+--time-limit $arg3} ;;
    fit) python3 -m autofuse fit --db tuning_db/h200x2.db --mode "${arg1:-graph}" --report "$W/fit-${arg1:-graph}.json" \
           && python3 -m autofuse export --db tuning_db/h200x2.db --mode "${arg1:-graph}" --format csv \
           && python3 -m autofuse export --db tuning_db/h200x2.db --mode "${arg1:-graph}" --format json \
           && cp models/*.json tuning_db/*.csv tuning_db/*.json "$W/" ;;
    eval) python3 scripts/eval_dispatch_gpu.py --policy "$(ls models/*-"${arg1:-graph}".json | head -1)" \
            --mode "${arg1:-graph}" --out "$W/eval-${arg1:-graph}.json" ;;
    dispatch) python3 scripts/bench_dispatch.py --out "$W/bench_dispatch.json" ;;
    *) echo "unknown stage $stage"; status=1; continue ;;
  esac > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "    rc=$rc in $(( $(date +%s) - t0 )) s; tail:"; tail -n 25 "$log"
  cp tuning_db/*.db "$W/" 2>/dev/null
  tar czf "$OUT/results.tgz" -C "$W" .   # after every stage, so a run cut short still returns its results
done
exit $status
