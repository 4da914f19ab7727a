"""Reproduce (or clear) the survivor's hang of a late-peer fault in gemm_rs on two GPUs.

Per plan row: build the variant with a 2 s wait budget and make one good call; then rank 1 sleeps
3 s before its second call while rank 0's second call runs, and rank 0 polls its stream (no
blocking synchronize) for 12 s, printing each second the host mirror, the epoch counter
[epoch, programs done] and the status words (read on a side stream). A call that is not done by
then is reported HUNG and the job stops (the GPU stays stuck). On two H200 (2026-11-23,
docs/results/2026-11-23-round2-session4): one tile per program (M=128, and M=1000 N=1024 K=2048)
finished in 2.0 s; M=1000 N=8192 K=14336 (512 tiles over 132 programs) HUNG on the TMA and the
pointer paths, 105-114 programs done. Branch fix/uniform-fault-decisions holds the suspected fix;
run this after it to check it.

    python3 scripts/diag_fault_hang.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def job(world, plan):
    import harness
    from autofuse.comm import status
    from autofuse.ops import gemm_rs
    from autofuse.comm.workspace import workspaces

    os.environ[status.TIMEOUT_ENV] = "2"
    side = torch.cuda.Stream()
    out = []
    for variant, dims, dtype, config in plan:
        op = gemm_rs.OP
        problem = harness.problem_of(op, world.size, dims, dtype)
        runner = op.variant(variant).build(world, problem, config)
        ws = runner.workspaces[0]
        inputs = op.inputs(world, problem, 0)
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
        world.sync()
        tag = f"rank {world.rank} {variant} {dims} {dtype}"
        if world.rank == 1:
            time.sleep(3.0)
        t0 = time.monotonic()
        inputs = op.inputs(world, problem, 1)
        runner(*inputs, out=o)
        done = False
        while time.monotonic() - t0 < 12:
            if torch.cuda.current_stream().query():
                done = True
                break
            with torch.cuda.stream(side):
                counter = ws.counter.to("cpu").tolist()
                code = ws.status.to("cpu").tolist()[:4]
            print(f"{tag}: {time.monotonic() - t0:5.1f} s running; mirror {int(ws.mirror[0])} counter {counter} "
                  f"status {code}", file=sys.__stderr__, flush=True)
            time.sleep(1.0)
        print(f"{tag}: {'finished' if done else 'HUNG'} after {time.monotonic() - t0:.1f} s; mirror "
              f"{int(ws.mirror[0])}", file=sys.__stderr__, flush=True)
        if not done:
            os._exit(3)
        try:
            runner.check()
            what = "returned"
        except Exception as exc:
            what = type(exc).__name__
        out.append((tag, what))
        world.sync()
        for w in workspaces(world):
            w.rebuild()
        world.sync()
    return out


if __name__ == "__main__":
    from autofuse.comm.world import spawn

    if torch.cuda.device_count() < 2:
        sys.exit("diag_fault_hang.py needs two GPUs (the hang is a GPU scheduling matter; CPU ranks never showed it)")

    tile = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    big = {"M": 1000, "N": 8192, "K": 14336}
    plan = [("push_last", {"M": 128, "N": 8192, "K": 14336}, "bfloat16", {**tile, "PARTIAL": "out"}),
            ("push_last", big, "bfloat16", {**tile, "PARTIAL": "fp32", "TMA": False}),
            ("push_reducer", big, "bfloat16", {**tile, "PARTIAL": "fp32", "FLAG": "tile", "COMM_SMS": 8}),
            ("push_last", {"M": 264, "N": 8192, "K": 14336}, "bfloat16", {**tile, "PARTIAL": "out"}),
            ("push_last", big, "bfloat16", {**tile, "PARTIAL": "out"})]
    print(spawn(job, 2, plan, device_kind="cuda", timeout_s=200))
