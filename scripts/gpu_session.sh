#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels and the project offline (once per
# machine), then run the named stages in order, each with a time limit, logging each under the
# session's folder; one tarball $OUT/NAME.tgz is rewritten after every stage, so a run cut short
# still returns what it did. Several sessions may run at once on different GPUs, e.g.
#   bash scripts/gpu_session.sh --name a --gpus 0,1 STAGE... & bash scripts/gpu_session.sh --name b --gpus 3 STAGE...
# Options: --ranks-per-gpu N (AUTOFUSE_RANKS_PER_GPU: up to N ranks share a GPU; tests and diagnostics
# only, nothing is timed), --world N (AUTOFUSE_TEST_WORLD: ranks of the multi-rank GPU tests), --heap SIZE
# (AUTOFUSE_HEAP_SIZE). Every stage adds PASS/FAIL lines to NAME-summary.txt (in $OUT too), printed last.
# One GPU, every multi-rank GPU test at 2 ranks on it, in three waves of parallel pytest processes (26 at
# once ran the GPU out of memory in the float64 references): the heavy case tables and the hang check, the
# other tables (graph replays included) and the GEMM core, then the fault, group, dispatch and call tests:
#   bash scripts/gpu_session.sh --name onegpu-w2 --ranks-per-gpu 4 --world 2 --heap 1G \
#     together:test_gemm_rs,test_ag_gemm:240:gpu_cases+or+sizes_that_hung \
#     together:test_gemm_ar,test_flash_decode,test_collectives,test_hybrid,test_gemm_core:270:not+test_gpu_faults \
#     together:test_gemm_rs,test_gemm_ar,test_ag_gemm,test_flash_decode,test_collectives,test_groups,test_dispatch,test_calls:150:test_gpu_faults+and+not+sizes_that_hung+or+test_groups+or+test_dispatch+or+test_calls
# (--world 4: the same at 4 ranks on the GPU, in smaller waves: 11 tests at once, 44 processes on one GPU and 16
# CPU cores, made ranks miss 4 s agreement budgets and the host kill one; the same tests passed one after the other.)
# Stages (LIMIT: seconds, default 300):
#   pytest:FILES[:LIMIT[:KEXPR]]    pytest -m gpu on tests/FILES (comma-separated file stems, e.g. test_ag_gemm),
#                                   -k KEXPR if given ('+' for spaces)
#   together:FILES[:LIMIT[:KEXPR]]  every GPU test of tests/FILES as its own pytest process, all at once on the
#                                   same GPUs (-v --durations=0, one log each, a PASS/FAIL line each): for the
#                                   correctness tables, whose time is mostly Triton compiles on a cold cache;
#                                   tests that assert timings (faults) belong in a plain pytest stage
#   doctor[:PROVIDER]               autofuse doctor (AUTOFUSE_HEAP_PROVIDER=PROVIDER if given)
#   bench:TARGET[:SWEEP[:LIMIT[:ARGS]]]  autofuse bench TARGET --sweep SWEEP (ARGS: extra options, '+' for spaces)
#   tune:OPS:MINUTES[:WORLDS[:SWEEP[:TRIALS]]]  autofuse tune into NAME.db (ops comma-separated or 'all')
#   fit[:MODE]                      autofuse fit on NAME.db (graph and eager by default): policy + report per mode
#   export[:MODE]                   autofuse export (csv + json) and show --json of NAME.db
#   eval[:MODE]                     held-out dispatch quality of the fitted policy (scripts/eval_dispatch_gpu.py)
#   dispatch                        cached-call dispatch overhead (scripts/bench_dispatch.py)
#   sh:COMMAND                      anything else ('+' for spaces; everything after "sh:" is the command,
#                                   colons included; time limit SH_LIMIT seconds, default 300)
set -uo pipefail
NAME=session; GPUS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --name) NAME=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --ranks-per-gpu) export AUTOFUSE_RANKS_PER_GPU=$2; shift 2 ;;
    --world) export AUTOFUSE_TEST_WORLD=$2; shift 2 ;;
    --heap) export AUTOFUSE_HEAP_SIZE=$2; shift 2 ;;
    *) break ;;
  esac
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1 COLUMNS=${COLUMNS:-120} PYTHONWARNINGS=ignore::FutureWarning
[ -n "$GPUS" ] && export CUDA_VISIBLE_DEVICES=$GPUS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/work-$NAME; rm -rf "$W"; mkdir -p "$W"
DB=$W/$NAME.db
if [ ! -f /tmp/site/.installed ]; then
  ( flock 9
    if [ ! -f /tmp/site/.installed ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null \
        && touch /tmp/site/.installed
    fi ) 9>/tmp/site.lock
fi
export PYTHONPATH=/tmp/site
[ -f /tmp/site/.installed ] || { echo "offline install failed"; exit 1; }
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all} AUTOFUSE_RANKS_PER_GPU=${AUTOFUSE_RANKS_PER_GPU:-1}" \
       "AUTOFUSE_TEST_WORLD=${AUTOFUSE_TEST_WORLD:-2} AUTOFUSE_HEAP_SIZE=${AUTOFUSE_HEAP_SIZE:-default}"
  } > "$W/machine.txt" 2>&1
SUMMARY=$W/$NAME-summary.txt; : > "$SUMMARY"
status=0
for stage in "$@"; do
  IFS=: read -r what a1 a2 a3 a4 a5 <<< "$stage"
  log="$W/${what}${a1:+-${a1//[,\/]/_}}${a2:+-${a2//\//_}}.log"
  echo "=== [$NAME] $stage ($(date -u +%H:%M:%S))"
  t0=$(date +%s)
  files=$(echo "$a1" | tr ',' '\n' | sed 's#^#tests/#; s#$#.py#' | tr '\n' ' ')  # pytest and together: FILES
  case "$what" in
    pytest) timeout "${a2:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" $files \
              ${a3:+-k "${a3//+/ }"} ;;
    together) ids=$(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider -o addopts="" $files \
                      ${a3:+-k "${a3//+/ }"} | grep '::')
              [ -n "$ids" ] || { echo "no GPU test matched"; false; }
              : > "$W/together.txt"
              for id in $ids; do
                ( tag=$(echo "$id" | sed 's#^tests/##; s#[^A-Za-z0-9_.-]#_#g')
                  timeout -k 10 "${a2:-300}" python3 -m pytest -v -rsP -m gpu -p no:cacheprovider -o addopts="" \
                    --durations=0 "$id" > "$W/together-$tag.log" 2>&1
                  rc=$?; verdict="FAIL(rc=$rc)"
                  [ $rc -eq 0 ] && verdict=$(grep -q " passed" "$W/together-$tag.log" && echo PASS || echo \
                    "SKIPPED($(grep -o 'SKIPPED \[.*' "$W/together-$tag.log" | head -1 | cut -c1-110))")
                  echo "$verdict $id $(grep -Eo 'in [0-9.]+s' \
                    "$W/together-$tag.log" | tail -1)" | tee -a "$W/together.txt" ) &
              done
              wait
              sed "s#^#[$stage] #" "$W/together.txt" >> "$SUMMARY"
              ! grep -q FAIL "$W/together.txt" ;;
    doctor) AUTOFUSE_HEAP_PROVIDER=${a1:-} timeout 180 python3 -m autofuse doctor --out "$W/doctor${a1:+-$a1}.json" ;;
    bench) timeout "${a3:-300}" python3 -m autofuse bench "$a1" --sweep "${a2:-gpu}" ${a4//+/ } \
             --out "$W/bench-$a1-${a2:-gpu}.json" --force ;;
    tune) ops=$([ "$a1" = all ] && echo "" || echo "--op $a1")
          timeout $(( ${a2:-5} * 60 + 120 )) python3 -m autofuse tune $ops --db "$DB" --time-limit "${a2:-5}" \
            ${a3:+--world $a3} ${a4:+--sweep $a4} ${a5:+--trials $a5} ;;
    fit) for m in ${a1:-graph eager}; do
           timeout 300 python3 -m autofuse fit --db "$DB" --mode "$m" --out "$W/policy-$m.json" \
             --report "$W/fit-$m.json" --force || false
         done ;;
    export) for m in ${a1:-graph eager}; do
              timeout 120 python3 -m autofuse export --db "$DB" --mode "$m" --format csv --out "$W/tuning-$m.csv" --force \
                && timeout 120 python3 -m autofuse export --db "$DB" --mode "$m" --format json --out "$W/tuning-$m.json" --force \
                && timeout 120 python3 -m autofuse show --db "$DB" --mode "$m" --json > "$W/show-$m.json" || false
            done ;;
    eval) timeout 400 python3 scripts/eval_dispatch_gpu.py --policy "$W/policy-${a1:-graph}.json" \
            --mode "${a1:-graph}" --out "$W/eval-${a1:-graph}.json" ;;
    dispatch) timeout 200 python3 scripts/bench_dispatch.py --out "$W/bench_dispatch.json" ;;
    sh) cmd=${stage#sh:}; timeout "${SH_LIMIT:-300}" bash -c "${cmd//+/ }" ;;
    *) echo "unknown stage $stage"; false ;;
  esac > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$([ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)") stage $stage in $(( $(date +%s) - t0 )) s" >> "$SUMMARY"
  echo "    rc=$rc in $(( $(date +%s) - t0 )) s; tail:"; tail -n "${TAIL:-15}" "$log"
  cp "$SUMMARY" "$OUT/"
  tar czf "$OUT/$NAME.tgz" -C "$W" .
done
echo "=== [$NAME] summary ($(head -1 "$W/machine.txt"); $(grep AUTOFUSE_RANKS "$W/machine.txt"))"
cat "$SUMMARY"
exit $status
