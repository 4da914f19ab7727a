"""Check that a late peer in a fused gemm_rs call makes every rank raise, at sizes that used to hang.

Per plan row: build the variant with a 2 s wait budget and make one good call; then the last rank
sleeps 3 s before its second call while the others' second calls run, and they poll their streams
(no blocking synchronize) for 12 s, printing each second the host mirror, the epoch counter
[epoch, programs done] and the status words (read on a side stream). A call that is not done by
then is reported HUNG and the job stops (the GPU stays stuck); a call that ends must raise
(FlagTimeout on the ranks that waited, WorkspaceAborted on the late one) within the budget + 5 s.
A PASS/FAIL table comes last; the exit status is 0 only if every row passed.

History: on two H200 (2026-11-23, docs/results/2026-11-23-round2-session4), one tile per program
(M=128, and M=1000 N=1024 K=2048) finished in 2.0 s; M=1000 N=8192 K=14336 (512 tiles over 132
programs) HUNG on the TMA and the pointer paths, 105-114 programs done, because the kernels read the
fault status per thread. Two ranks on one H100 reproduced it exactly (2026-11-25). The kernels now
make every fault decision once per program (kernels/shmem.py); since then every row passes with two
ranks on one H100 (2026-11-25, docs/results/2026-11-25-round3).

    python3 scripts/diag_fault_hang.py [--world N]      # N ranks, one GPU each
    AUTOFUSE_RANKS_PER_GPU=4 python3 scripts/diag_fault_hang.py --world 4   # N ranks on fewer GPUs
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

BUDGET_S = 2.0
LATE_S = 3.0   # the last rank's sleep: past the budget
POLL_S = 12.0  # how long a rank waits for its call's kernel to end before calling it HUNG
SLACK_S = 5.0  # harness.check_fault_run's bound: every rank raises within the budget + 5 s


def job(world, plan):
    import harness
    from autofuse.comm import status
    from autofuse.comm.workspace import workspaces
    from autofuse.ops import gemm_rs

    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(BUDGET_S)
    side = torch.cuda.Stream()
    late = world.size - 1
    out = []
    for variant, dims, dtype, config in plan:
        op = gemm_rs.OP
        problem = harness.problem_of(op, world.size, dims, dtype)
        runner = op.variant(variant).build(world, problem, config)
        ws = runner.workspaces[0]
        inputs = op.inputs(world, problem, 0)
        o = torch.empty(0)
        row = (f"{variant} M={dims['M']} N={dims['N']} K={dims['K']} {dtype}"
               + ("" if config.get("TMA", True) else " pointer") + f" PARTIAL={config.get('PARTIAL')}")
        for attempt in range(2):  # the first call compiles: a slow rank may exceed the 2 s budget
            failed = 0.0
            try:
                o = runner(*inputs)
                runner.check()
            except Exception as exc:
                failed = 1.0
                print(f"rank {world.rank}: call 0 raised {type(exc).__name__}", file=sys.__stderr__, flush=True)
            if world.rank_max(failed) == 0:
                break
            world.sync()
            for w in workspaces(world):
                w.rebuild()
            world.sync()
        else:  # no good first call: nothing to check the fault against
            out.append({"row": row, "rank": world.rank, "late": world.rank == late, "outcome": "call 0 failed",
                        "seconds": 0.0})
            continue
        world.sync()
        tag = f"rank {world.rank} {variant} {dims} {dtype}"
        if world.rank == late:
            time.sleep(LATE_S)
        t0 = time.monotonic()
        inputs = op.inputs(world, problem, 1)
        what = "returned"
        try:
            runner(*inputs, out=o)
        except (status.FlagTimeout, status.WorkspaceAborted) as exc:  # refused at once (a peer aborted it)
            what = type(exc).__name__
        done = what != "returned"
        while not done and time.monotonic() - t0 < POLL_S:
            if torch.cuda.current_stream().query():
                done = True
                break
            with torch.cuda.stream(side):
                counter = ws.counter.to("cpu").tolist()
                code = ws.status.to("cpu").tolist()[:4]
            print(f"{tag}: {time.monotonic() - t0:5.1f} s running; mirror {int(ws.mirror[0])} counter {counter} "
                  f"status {code}", file=sys.__stderr__, flush=True)
            time.sleep(1.0)
        seconds = time.monotonic() - t0
        print(f"{tag}: {'finished' if done else 'HUNG'} after {seconds:.1f} s; mirror {int(ws.mirror[0])}",
              file=sys.__stderr__, flush=True)
        if not done:
            print(f"{tag}: HUNG: stopping the job (the GPU stays stuck)", file=sys.__stderr__, flush=True)
            os._exit(3)
        if what == "returned":
            try:
                runner.check()
            except (status.FlagTimeout, status.WorkspaceAborted) as exc:
                what = type(exc).__name__
        out.append({"row": row, "rank": world.rank, "late": world.rank == late, "outcome": what, "seconds": seconds})
        world.sync()
        for w in workspaces(world):
            w.rebuild()
        world.sync()
    return out


def verdict(r: dict) -> str:
    """PASS where the call raised within the budget + slack (the late rank: at once, its peers aborted it)."""
    if r["outcome"] in ("returned", "call 0 failed"):
        return f"FAIL ({r['outcome']})"
    return "PASS" if r["seconds"] <= BUDGET_S + SLACK_S else f"FAIL (raised after {r['seconds']:.1f} s)"


def fitted(config: dict, m: int, world: int) -> dict:
    """`config` with BLOCK_M no larger than a rank's share of the M rows needs (push_last's GEMM runs
    ceil(M / world) rows a destination: M=128 at 4 ranks is 32 rows, which a 64-row block refuses)."""
    from autofuse.core import gemm

    return {**config, "BLOCK_M": min(config["BLOCK_M"], max(16, gemm.next_pow2(-(-m // world))))}


def main() -> int:
    from autofuse.comm.world import RankFailed, device_plan, spawn
    from autofuse.core import settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2); AUTOFUSE_RANKS_PER_GPU lets them share GPUs")
    args = ap.parse_args()
    try:
        device_plan(args.world, settings.ranks_per_gpu())
    except ValueError as exc:
        sys.exit(f"diag_fault_hang.py: {exc} (the hang is a GPU scheduling matter; CPU ranks never showed it)")
    tile = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    big = {"M": 1000, "N": 8192, "K": 14336}
    plan = [("push_last", {"M": 128, "N": 8192, "K": 14336}, "bfloat16", {**tile, "PARTIAL": "out"}),
            ("push_last", big, "bfloat16", {**tile, "PARTIAL": "fp32", "TMA": False}),
            ("push_reducer", big, "bfloat16", {**tile, "PARTIAL": "fp32", "FLAG": "tile", "COMM_SMS": 8}),
            ("push_reducer", big, "bfloat16", {**tile, "PARTIAL": "out", "FLAG": "row_block", "COMM_SMS": 8}),
            ("push_last", {"M": 264, "N": 8192, "K": 14336}, "bfloat16", {**tile, "PARTIAL": "out"}),
            ("push_last", big, "bfloat16", {**tile, "PARTIAL": "out"})]
    plan = [(v, dims, dt, fitted(config, dims["M"], args.world)) for v, dims, dt, config in plan]
    try:
        per_rank = spawn(job, args.world, plan, device_kind="cuda", timeout_s=100 + 60 * len(plan))
    except RankFailed as exc:
        print(f"diag_fault_hang.py: FAIL: {str(exc).splitlines()[0]}")
        return 1
    rows = [r for ranks in zip(*per_rank) for r in ranks]
    width = max(len(r["row"]) for r in rows)
    print(f"\n{'row':{width}}  rank      outcome            s  verdict")
    for r in rows:
        who = f"{r['rank']}{' late' if r['late'] else ''}"
        print(f"{r['row']:{width}}  {who:8}  {r['outcome']:16} {r['seconds']:5.1f}  {verdict(r)}")
    failed = [r for r in rows if verdict(r) != "PASS"]
    print(f"diag_fault_hang.py: {'PASS' if not failed else 'FAIL'}: {len(rows) - len(failed)} of {len(rows)} rank-rows "
          f"raised within {BUDGET_S + SLACK_S:.0f} s at world {args.world}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
