#!/usr/bin/env bash
# Issue 29 on one H100 (or H200), about 7 minutes: the GEMM core's GPU tests (stream-K and FP8
# against float64, bitwise CUDA-graph replays), the bf16 sweep against cuBLAS and the FP8 sweep
# against torch._scaled_mm (graph mode, `autofuse bench gemm_core`), then the FP8 correctness of
# every op's variants at world 2 on this one GPU (two ranks per GPU, CUDA-graph replay included),
# and a short table last. Runs through scripts/gpu_session.sh (offline install, a time limit and a
# log per stage, everything in $OUT/fp8.tgz); the bench JSONs are also copied to $OUT.
#   bash scripts/gpu_fp8.sh            # from the repository root, OUT=/path/for/results
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; export OUT
W=/tmp/work-fp8
SWEEP_ARGS="--mode+graph+--reps+10+--variants+tma,swap,splitk,streamk+--quiet"
stages=(
  "pytest:test_gemm_core:150"
  "sh:python3+-m+autofuse+bench+gemm_core+--sweep+gpu+--dtype+bf16+$SWEEP_ARGS+--out+$W/bench-gemm_core-bf16.json+--force"
  "sh:python3+-m+autofuse+bench+gemm_core+--sweep+gpu+--dtype+fp8+$SWEEP_ARGS+--out+$W/bench-gemm_core-fp8.json+--force"
)
if ls tests/test_fp8_ops.py >/dev/null 2>&1; then
  stages+=("pytest:test_fp8_ops:150")
fi
SH_LIMIT=${SH_LIMIT:-170} bash scripts/gpu_session.sh --name fp8 "${stages[@]}"
status=$?
cp "$W"/bench-gemm_core-*.json "$OUT"/ 2>/dev/null
python3 - "$W" <<'EOF'
import json, pathlib, re, sys
w = pathlib.Path(sys.argv[1])
print("\n=== issue 29 summary (graph mode; x = core / vendor time, geomean)")
targets = {"bf16": ("cuBLAS", 1.05, 1.03, 1.10), "fp8": ("_scaled_mm", 1.05, 1.05, 1.15)}
for dtype, (vendor, small, large, shape) in targets.items():
    f = w / f"bench-gemm_core-{dtype}.json"
    if not f.exists():
        print(f"{dtype:5} no result ({f.name} missing: see its stage log)")
        continue
    doc = json.loads(f.read_text())
    s = doc.get("summary", {}).get("graph", {})
    g = lambda k: "-" if s.get(k) is None else f"{s[k]:.3f}"
    print(f"{dtype:5} vs {vendor:10}: M<=256 {g('M<=256')} (target {small}, no stream-K {g('M<=256 dp')}), "
          f"M>=512 {g('M>=512')} (target {large}, no stream-K {g('M>=512 dp')}), "
          f"{s.get('met', '-')} of {s.get('of', '-')} shapes <= {shape}x"
          + (f", rowwise {g('rowwise')}" if s.get("rowwise") else ""))
for log in sorted(w.glob("pytest-*.log")):
    tail = [l for l in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    print(f"{log.stem:28} {tail[-1].strip() if tail else 'no pytest summary (see the log)'}")
EOF
exit $status
