"""One variant's rows of an op's GPU case table on this machine's GPUs, without the other variants' kernels.

Runs the rows of `GPU_CASES` in tests/test_<op>.py whose variant is VARIANT (eager calls, then CUDA-graph
replays, each against the float64 reference: tests/harness.py), and with --faults the late-peer,
skipped-call and dead-peer scenarios of the variant at the test file's MID dims (every rank must raise
within the wait budget, none may return a wrong result). What `pytest -m gpu tests/test_<op>.py` checks
for that variant, in a minute instead of compiling every fused kernel of the op on a cold cache:

    python3 scripts/gpu_variant_cases.py gemm_rs mm_ring --faults '{"CHUNKS": 2}'
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op")
    ap.add_argument("variant")
    ap.add_argument("--faults", metavar="CONFIG", help="also the fault scenarios at this config (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    os.environ.setdefault("AUTOFUSE_RING_MIN_GFLOP", "0")  # the test tables' sizes, as the tests run them
    import harness
    from _row_parallel import check_faults_on_gpus, fault_plan
    from autofuse.comm.world import spawn

    module = importlib.import_module(f"test_{args.op}")
    cases = [c for c in module.GPU_CASES if c[0] == args.variant]
    if not cases:
        print(f"tests/test_{args.op}.py has no GPU case of {args.variant}", file=sys.stderr)
        return 2
    results = spawn(harness.gpu_cases, harness.gpu_world(), module.OP, cases, device_kind="cuda", timeout_s=580)
    for row in results[0]:
        print(row)
    harness.assert_ok(results)
    print(f"{args.op}.{args.variant}: {len(cases)} GPU cases passed (eager and graph replay) on "
          f"{harness.gpu_world()} ranks")
    if args.faults is not None:
        check_faults_on_gpus(module.OP, fault_plan(module.MID, "bfloat16", ((args.variant, json.loads(args.faults)),)))
        print(f"{args.op}.{args.variant}: late peer, skipped call and dead peer raised on every rank, no wrong result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
