#!/usr/bin/env bash
# The GEMM core's wide config search (`autofuse bench gemm_core --search wide`, graph mode, reps 5), bf16
# against cuBLAS and FP8 against torch._scaled_mm: with two GPUs each dtype on its own GPU at once, with
# one GPU one after the other. Shapes: BF16_SHAPES / FP8_SHAPES (--shapes items; default: the gpu sweep).
# Each run compiles its distinct configs in parallel processes first (Triton's cache), then times alone.
# JSONs and logs in $OUT (wide-DTYPE.json); a table of the best configs per shape is printed last.
#   BF16_SHAPES=256x5120,512 FP8_SHAPES=64 bash scripts/gpu_wide.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; export OUT
if [ "${1:-}" = "--one" ]; then  # one dtype (called as a gpu_session.sh stage below): --one DTYPE
  shapes=$([ "$2" = bf16 ] && echo "${BF16_SHAPES:-}" || echo "${FP8_SHAPES:-}")
  exec python3 -m autofuse bench gemm_core --sweep gpu --dtype "$2" --search wide --mode graph --reps 5 --quiet \
    ${shapes:+--shapes "$shapes"} --out "$OUT/wide-$2.json" --force
fi
export BF16_SHAPES=${BF16_SHAPES:-} FP8_SHAPES=${FP8_SHAPES:-}
gpus=$(nvidia-smi -L | wc -l)
run() {  # DTYPE GPU
  SH_LIMIT=${SH_LIMIT:-560} bash scripts/gpu_session.sh --name "wide-$1" --gpus "$2" "sh:bash+scripts/gpu_wide.sh+--one+$1"
}
if [ "$gpus" -ge 2 ]; then
  run bf16 0 > "$OUT/wide-bf16.log" 2>&1 &
  run fp8 1 > "$OUT/wide-fp8.log" 2>&1
  wait
else
  run bf16 0 > "$OUT/wide-bf16.log" 2>&1
  run fp8 0 > "$OUT/wide-fp8.log" 2>&1
fi
PYTHONPATH=/tmp/site:$PWD python3 scripts/wide_table.py "$OUT"/wide-*.json
