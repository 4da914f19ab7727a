#!/usr/bin/env bash
# Issue 29 on one H100 (or H200), about 7-8 minutes: the GEMM core's GPU tests (stream-K and FP8
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
if [ "${1:-}" = "--half" ]; then  # one half of a sweep (called as a stage below): --half DTYPE K
  shapes=$(for n in 3584 5120 8192 28672; do for m in 16 64 128 256 512 1024 4096 16384; do
             printf '%sx%sx%s,' "$m" "$n" "$3"; done; done)
  exec python3 -m autofuse bench gemm_core --sweep gpu --dtype "$2" --shapes "${shapes%,}" --mode graph --reps 10 \
    --quiet --out "$W/bench-gemm_core-$2-k$3.json" --force
fi
stages=("pytest:test_gemm_core:150")
for dtype in bf16 fp8; do  # each sweep in two halves (K = 8192, 14336): a half cut short loses only itself
  for k in 8192 14336; do
    stages+=("sh:bash+scripts/gpu_fp8.sh+--half+$dtype+$k")
  done
done
stages+=("pytest:test_fp8_ops:300")  # two ranks on this one GPU (gpu_session.sh --ranks-per-gpu)
SH_LIMIT=${SH_LIMIT:-120} bash scripts/gpu_session.sh --name fp8 --ranks-per-gpu 2 --world 2 "${stages[@]}"
status=$?
cp "$W"/bench-gemm_core-*.json "$OUT"/ 2>/dev/null
python3 - "$W" <<'EOF'
import json, math, pathlib, re, sys
w = pathlib.Path(sys.argv[1])
print("\n=== issue 29 summary (graph mode; x = core / vendor time, geomean)")
targets = {"bf16": ("cuBLAS", 1.05, 1.03, 1.10), "fp8": ("_scaled_mm", 1.05, 1.05, 1.15)}
for dtype, (vendor, small, large, shape) in targets.items():
    rows = []
    for f in sorted(w.glob(f"bench-gemm_core-{dtype}-k*.json")):
        rows += [r for r in json.loads(f.read_text())["rows"] if r["mode"] == "graph"]
    if not rows:
        print(f"{dtype:5} no result (see the bench stage logs)")
        continue
    def geo(xs):
        xs = [x for x in xs if x]
        return "-" if not xs else f"{math.exp(sum(map(math.log, xs)) / len(xs)):.3f}"
    part = lambda small_m: [r for r in rows if (r["M"] <= 256) == small_m and r["core_us"]]
    x = lambda rs: [r["core_us"] / r["cublas_us"] for r in rs]
    dp = lambda rs: [r["dp_us"] / r["cublas_us"] for r in rs if r.get("dp_us")]
    met = sum(1 for r in rows if r["core_us"] and r["core_us"] / r["cublas_us"] <= shape)
    rowwise = [r["rowwise_core_us"] / r["rowwise_vendor_us"] for r in rows if r.get("rowwise_vendor_us")]
    print(f"{dtype:5} vs {vendor:10}: M<=256 {geo(x(part(True)))} (target {small}, no stream-K {geo(dp(part(True)))}), "
          f"M>=512 {geo(x(part(False)))} (target {large}, no stream-K {geo(dp(part(False)))}), "
          f"{met} of {len(rows)} shapes <= {shape}x" + (f", rowwise {geo(rowwise)}" if rowwise else ""))
for log in sorted(w.glob("pytest-*.log")):
    tail = [l for l in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    print(f"{log.stem:28} {tail[-1].strip() if tail else 'no pytest summary (see the log)'}")
EOF
exit $status
