#!/usr/bin/env bash
# The GEMM core's sweep (`autofuse bench gemm_core --search SEARCH`, graph mode), bf16 against cuBLAS and
# FP8 against torch._scaled_mm: with two GPUs each dtype on its own GPU at once, with one GPU one after the
# other. SEARCH: defaults (the configs the ops try first; the default) or wide (a grid of 40-280 configs a
# shape). REPS: timed batches (default 10). Shapes: BF16_SHAPES / FP8_SHAPES (--shapes items; default: the
# gpu sweep, 64 shapes). Each run compiles its distinct configs in parallel processes first (Triton's
# cache), then times alone. JSONs and logs in $OUT (core-SEARCH-DTYPE.json); a table per dtype last.
#   bash scripts/gpu_core_sweep.sh                                              # issue 29's sweep
#   SEARCH=wide REPS=5 BF16_SHAPES=256x5120,512 FP8_SHAPES=64 bash scripts/gpu_core_sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; export OUT
SEARCH=${SEARCH:-defaults}; REPS=${REPS:-10}; export SEARCH REPS
if [ "${1:-}" = "--one" ]; then  # one dtype (called as a gpu_session.sh stage below): --one DTYPE
  shapes=$([ "$2" = bf16 ] && echo "${BF16_SHAPES:-}" || echo "${FP8_SHAPES:-}")
  exec python3 -m autofuse bench gemm_core --sweep gpu --dtype "$2" --search "$SEARCH" --mode graph --reps "$REPS" \
    --quiet ${shapes:+--shapes "$shapes"} --out "$OUT/core-$SEARCH-$2.json" --force
fi
export BF16_SHAPES=${BF16_SHAPES:-} FP8_SHAPES=${FP8_SHAPES:-}
gpus=$(nvidia-smi -L | wc -l)
run() {  # DTYPE GPU
  SH_LIMIT=${SH_LIMIT:-560} bash scripts/gpu_session.sh --name "core-$SEARCH-$1" --gpus "$2" \
    "sh:bash+scripts/gpu_core_sweep.sh+--one+$1"
}
if [ "$gpus" -ge 2 ]; then
  run bf16 0 > "$OUT/core-$SEARCH-bf16.log" 2>&1 &
  run fp8 1 > "$OUT/core-$SEARCH-fp8.log" 2>&1
  wait
else
  run bf16 0 > "$OUT/core-$SEARCH-bf16.log" 2>&1
  run fp8 0 > "$OUT/core-$SEARCH-fp8.log" 2>&1
fi
PYTHONPATH=/tmp/site:$PWD python3 scripts/core_table.py "$OUT"/core-"$SEARCH"-*.json
