"""Does `autofuse warmup` take every first-call cost off a serving process's first request? (issue 43)

For each held-out problem (scripts/eval_dispatch_gpu.py's `held_out`: sizes no tuning run measured,
so the policy only predicts them and dispatch confirms each on first use), three phases, each its own
`autofuse.comm.world.spawn` (fresh rank processes: nothing in memory carries over):
- `cold`: the first call of every problem through the public entry point (`autofuse.<op>`), nothing
  warmed: seconds (rank max), whether a first-use confirmation ran, Triton kernels compiled;
- `warmup`: `autofuse.warmup_problems(keys, world)` of exactly those problems (the API that
  `autofuse warmup` runs on each rank): its seconds, its confirmations and compiles;
- `warm`: a new job again, the first call of every warmed problem (other input values than warmup's).

Honest cold vs warm: both cold and warm see the same problems, each from empty caches of its own.
The script owns a temporary folder and gives each phase pair its own set of the folders that persist
across processes (XDG_CACHE_HOME, XDG_DATA_HOME, AUTOFUSE_ONLINE_DB, TRITON_CACHE_DIR): `cold` runs on
set A, empty at its start; `warmup` and then `warm` share set B, empty at warmup's start. So the cold
first call of a problem pays what a request on a fresh machine pays, the warm one what a request pays
after `autofuse warmup`, and nothing the cold phase compiled or confirmed helps the warm one (splitting
the problems in halves instead would compare different problems). Nothing of the user's folders is
read or written. Every first-call phase starts with the same untimed preamble (the ops imported, a
device matmul, a barrier, Triton's driver loaded), so process start-up costs fall on neither side; the
first call of the first problem still pays this process's heap setup, in both phases alike.

What the columns read, never inferred from timings:
- confirmed?: dispatch's own counter of confirmations (`autofuse.dispatch.stats.confirmations`) grew
  during the call; `basis` is the decision's (`autofuse.explain`): `confirmed` with nothing timed
  now means the online store answered (what warmup recorded);
- compiles: Triton compilations during the call that were not loads from Triton's disk cache
  (`triton.knobs.compilation.listener`'s `cache_hit=False`; on a Triton without that knob, the
  cache manager's writes of a compiled kernel). On CPU ranks Triton's interpreter compiles nothing:
  always 0 there.
Target (issue 43): every warm first call runs with no confirmation and no compile.

Prints a table per problem and a summary; writes JSON to --out (after each phase, so a run cut short
keeps what it measured). Exit status 2 when a warm first call confirmed or compiled. Usage:

    python3 scripts/eval_warmup_gpu.py --policy POLICY.json --mode graph --world 2 --out eval-warmup.json
    python3 scripts/eval_warmup_gpu.py --cpu --ops gemm_ar --limit 1 --out /tmp/w.json   # CPU dry run

`--cpu`: CPU ranks, each op's first CPU-sweep problem (tiny), eager mode, confirmation on
(AUTOFUSE_ONLINE=1, one candidate beside BSP) so the confirm-and-persist path runs; without --policy
it fits a stand-in policy with one tuned problem per op (other than the evaluated ones), so that every
evaluated decision is a prediction ('unsure') that dispatch confirms on first use.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_dispatch_gpu import OPS, held_out  # noqa: E402 - the held-out problems, one list for both evaluations

from autofuse.comm.world import spawn, temporary_env  # noqa: E402
from autofuse.core import registry  # noqa: E402
from autofuse.core.op import Problem  # noqa: E402

def problems(ops: list[str], world: int, cpu: bool, limit: int) -> list[str]:
    """The problem keys to evaluate: held-out ones on GPUs, each op's first CPU-sweep problem with --cpu."""
    keys: list[str] = []
    for name in ops:
        ps = registry.get(name).sweep("cpu", world)[:1] if cpu else held_out(name, world)
        keys += [p.key for p in ps[:limit or None]]
    return keys


def stand_in_policy(ops: list[str], world: int, evaluated: list[str], path: str) -> str:
    """A policy of this machine with one tuned problem per op (none of `evaluated`): too few to fit a
    model, so every evaluated decision is 'unsure' and confirmed on first use (CPU dry runs)."""
    from autofuse.measure import environment
    from autofuse.tuning.fit import fit

    rows = []
    for name in ops:
        op = registry.get(name)
        tuned = next(p for p in reversed(op.sweep("cpu", world)) if p.key not in evaluated)
        for v in op.variants.values():
            config = next(iter(v.defaults(tuned)), None)
            if config is None or v.check(tuned, config):
                continue
            rows.append({"problem": tuned.key, "op": name, "variant": v.name, "config": config,
                         "median_us": 100.0 if v.name == "bsp" else 90.0})
    data = fit(rows, environment.fingerprint("cpu"), "eager").data
    with open(path, "w") as f:
        json.dump(data, f)
    return path


COMPILED: list[str] = []  # what compile_counter saw compiled, in order: kernel name and its constants (Triton 3.4+)


def compiled_since(start: int) -> list[str]:
    """The kernels compiled since COMPILED had `start` entries (what made a first call compile)."""
    return COMPILED[start:]


def compile_counter() -> Callable[[], int]:
    """Install a counter of Triton compilations in this process (disk-cache loads excluded); returns
    a function reading it. Triton 3.4+: the compilation listener, which also names each kernel in
    COMPILED; older: the cache manager's writes."""
    import triton
    import triton.compiler.compiler as tc

    count = [0]
    comp = getattr(getattr(triton, "knobs", None), "compilation", None)
    if comp is not None and hasattr(comp, "listener"):
        previous = comp.listener

        def listener(*, cache_hit: bool, **kw: Any) -> None:
            count[0] += not cache_hit
            if not cache_hit:
                src = kw.get("src")
                COMPILED.append(f"{getattr(src, 'name', '?')} {str(getattr(src, 'constants', ''))[:400]}")
            if previous is not None:
                previous(cache_hit=cache_hit, **kw)

        comp.listener = listener
    else:
        get = tc.get_cache_manager

        def counting(key: str) -> Any:
            manager = get(key)
            put_group = manager.put_group

            def put(*a: Any, **kw: Any) -> Any:
                count[0] += 1
                return put_group(*a, **kw)

            manager.put_group = put
            return manager

        tc.get_cache_manager = counting
    return lambda: count[0]


def _preamble(world: Any, ops: list[str]) -> float:
    """Process start-up costs no warmup can take away, paid before any first call is timed: the ops
    imported, a device matmul (cuBLAS), a barrier (the communicator), Triton's driver (its launcher
    utilities), and dispatch's policy with this machine's fingerprint (every op's code digest; on GPUs
    nvidia-smi), which a process's first dispatched call pays once, whatever its shape. Returns the
    seconds of the last (the process setup a serving process's first request pays, warmed or not)."""
    import torch

    from autofuse.dispatch.policy_files import policy_for

    for name in ops:
        registry.get(name)
    x = torch.ones(64, 64, device=world.device)
    (x @ x).sum().item()
    if world.device.type == "cuda":
        from triton.runtime import driver

        getattr(driver.active, "utils", None)  # loads (the first time: builds) Triton's CUDA utilities
        torch.cuda.synchronize(world.device)
    world.sync()
    t0 = time.perf_counter()
    policy_for(world)
    setup_s = time.perf_counter() - t0
    world.sync()
    return setup_s


def first_calls_job(world: Any, keys: list[str], seed: int) -> list[dict]:
    """One rank of `cold`/`warm`: the first call of every problem in this new process, one by one
    (each row also carries the process's setup seconds, `setup_s`)."""
    import torch

    import autofuse
    from autofuse import dispatch

    if world.device.type == "cpu":
        torch.set_num_threads(1)  # two ranks on few cores
    compiles = compile_counter()
    dispatch.reset()
    setup_s = _preamble(world, sorted({Problem.from_key(k).op for k in keys}))
    rows = []
    for key in keys:
        problem = Problem.from_key(key)
        op = registry.get(problem.op)
        inputs = op.inputs(world, problem, seed)
        world.sync()
        c0, n0, k0 = compiles(), dispatch.stats.confirmations, len(COMPILED)
        t0 = time.perf_counter()
        getattr(autofuse, problem.op)(*inputs, group=world)
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        seconds = time.perf_counter() - t0
        choice = autofuse.explain(problem.op, *inputs, group=world)
        conf = choice.confirmation
        rows.append({"problem": key, "op": problem.op, "seconds": seconds,
                     "confirmed": dispatch.stats.confirmations > n0, "compiles": compiles() - c0,
                     "compiled": compiled_since(k0),
                     "variant": choice.variant, "basis": choice.basis, "reason": choice.reason,
                     "confirm_build_s": conf.build_seconds if conf else None,
                     "confirm_timing_s": conf.timing_seconds if conf else None, "setup_s": setup_s})
        world.sync()
    return rows


def warmup_job(world: Any, keys: list[str]) -> dict:
    """One rank of `warmup`: `autofuse.warmup_problems` of every problem, as `autofuse warmup` runs it."""
    import torch

    import autofuse
    from autofuse import dispatch

    if world.device.type == "cpu":
        torch.set_num_threads(1)  # two ranks on few cores
    compiles = compile_counter()
    dispatch.reset()
    _preamble(world, sorted({Problem.from_key(k).op for k in keys}))
    t0 = time.perf_counter()
    report = autofuse.warmup_problems(keys, world)
    return dict(report.as_dict(), wall_s=time.perf_counter() - t0, compiles=compiles())


def folders(root: str, name: str) -> dict[str, str]:
    """A phase pair's own persistent folders under `root` (empty when made)."""
    base = os.path.join(root, name)
    paths = {"XDG_CACHE_HOME": os.path.join(base, "cache"), "XDG_DATA_HOME": os.path.join(base, "data"),
             "TRITON_CACHE_DIR": os.path.join(base, "triton")}
    for p in paths.values():
        os.makedirs(p)
    return dict(paths, AUTOFUSE_ONLINE_DB=os.path.join(base, "online.db"))


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per problem: seconds and compiles the rank max, confirmed if any rank confirmed."""
    out = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        row.update(seconds=max(r["seconds"] for r in rows), compiles=max(r["compiles"] for r in rows),
                   setup_s=max(r["setup_s"] for r in rows),
                   confirmed=any(r["confirmed"] for r in rows), rank_compiles=[r["compiles"] for r in rows])
        out.append(row)
    return out


def summarize(res: dict) -> dict:
    """Medians of the first calls cold and warm, counts of confirmations and compiles, and the target."""
    cold, warm = res.get("cold", []), res.get("warm", [])
    med = lambda rows: statistics.median([r["seconds"] for r in rows]) if rows else math.nan  # noqa: E731
    bases: dict[str, int] = {}
    for r in cold:
        bases[r["basis"]] = bases.get(r["basis"], 0) + 1
    return {"problems": len(res["problems"]), "cold_first_call_median_s": med(cold),
            "warm_first_call_median_s": med(warm), "warmup_s": res.get("warmup", {}).get("seconds", math.nan),
            "cold_setup_s": cold[0]["setup_s"] if cold else math.nan,
            "warm_setup_s": warm[0]["setup_s"] if warm else math.nan, "cold_bases": bases,
            "cold_confirmed": sum(r["confirmed"] for r in cold), "cold_compiles": sum(r["compiles"] for r in cold),
            "warm_confirmed": sum(r["confirmed"] for r in warm), "warm_compiled": sum(r["compiles"] > 0 for r in warm),
            "target_met": bool(warm) and not any(r["confirmed"] or r["compiles"] for r in warm)}


def show(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cold = {r["problem"]: r for r in res.get("cold", [])}
    warm = {r["problem"]: r for r in res.get("warm", [])}
    yes = lambda b: "[red]yes[/red]" if b else "no"  # noqa: E731
    t = Table(title=f"first call of each problem, cold vs after warmup ({res['mode']} mode, {res['world']} "
                    f"{'CPU' if res['cpu'] else 'GPU'} ranks)")
    for col in ("op", "problem", "cold s", "cold confirmed?", "cold compiles", "warm s", "warm confirmed?",
                "warm compiles", "warm basis"):
        t.add_column(col, justify="right" if col.endswith((" s", "compiles")) else "left",
                     overflow="fold" if col == "problem" else "ellipsis")
    for key in res["problems"]:
        c, w = cold.get(key), warm.get(key)
        t.add_row(Problem.from_key(key).op, key.split("|", 1)[1],
                  f"{c['seconds']:.3f}" if c else "-", ("yes" if c["confirmed"] else "no") if c else "-",
                  str(c["compiles"]) if c else "-", f"{w['seconds']:.3f}" if w else "-",
                  yes(w["confirmed"]) if w else "-", (f"[red]{w['compiles']}[/red]" if w["compiles"] else "0")
                  if w else "-", w["basis"] if w else "-")
    console = Console(width=max(160, Console().width))
    console.print(t)
    s = res["summary"]
    console.print(f"median first call: cold {s['cold_first_call_median_s']:.3f} s, warm "
                  f"{s['warm_first_call_median_s']:.3f} s (warmup took {s['warmup_s']:.1f} s); warm first calls "
                  f"with a confirmation: {s['warm_confirmed']}, with a compile: {s['warm_compiled']} of "
                  f"{len(res.get('warm', []))} (target 0: {'met' if s['target_met'] else 'MISSED'})"
                  + ("; CPU: Triton's interpreter compiles nothing, compiles read 0" if res["cpu"] else ""),
                  soft_wrap=True)
    console.print(f"process setup before the first calls (policy and fingerprint, once per process, warmed or not): "
                  f"cold {s['cold_setup_s']:.2f} s, warm {s['warm_setup_s']:.2f} s; cold decisions by basis: "
                  f"{s['cold_bases']}", soft_wrap=True)
    for w in res.get("warm", []):
        for kernel in w.get("compiled", []):
            console.print(f"[red]warm first call of {w['problem']} compiled[/red] {kernel}", soft_wrap=True)
    if res.get("cold") and not s["cold_confirmed"]:
        console.print("[yellow]no cold first call confirmed (a refused policy, or every problem tuned): the "
                      "comparison shows compiles only[/yellow]", soft_wrap=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", help="the policy dispatch uses (required on GPUs; --cpu: a stand-in by default)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--mode", default=None, help="graph (default on GPUs) or eager (the only mode on CPU)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="at most this many problems per op (0: all)")
    ap.add_argument("--out", default=os.path.join("autofuse-out", "eval_warmup.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders (printed) for inspection")
    ap.add_argument("--cpu", action="store_true", help="dry run of the code path on CPU ranks (tiny problems)")
    a = ap.parse_args()
    mode = a.mode or ("eager" if a.cpu else "graph")
    if a.cpu and mode != "eager":
        ap.error("--cpu runs eager mode only (CUDA graphs need GPUs)")
    if not a.cpu and not a.policy:
        ap.error("--policy is required on GPUs (the fitted policy, e.g. autofuse fit --out)")
    ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in ops if o not in registry.names()]
    if unknown:
        ap.error(f"unknown op(s) {', '.join(unknown)}: known ops are {', '.join(registry.names())}")
    root = tempfile.mkdtemp(prefix="autofuse-eval-warmup-")
    keys = problems(ops, a.world, a.cpu, a.limit)
    policy = os.path.abspath(a.policy) if a.policy else stand_in_policy(ops, a.world, keys,
                                                                       os.path.join(root, "policy.json"))
    res: dict[str, Any] = {"policy": policy, "mode": mode, "world": a.world, "cpu": a.cpu, "problems": keys,
                           "folders": root}
    common = {"AUTOFUSE_POLICY": policy, "AUTOFUSE_MODE": mode, "AUTOFUSE_ONLINE": "1"}
    if a.cpu:
        common["AUTOFUSE_CONFIRM_K"] = "1"
    kind = "cpu" if a.cpu else "cuda"

    def save() -> None:
        res["summary"] = summarize(res)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    try:
        with temporary_env({**common, **folders(root, "cold")}):
            print(f"cold: first calls of {len(keys)} problems, nothing warmed", flush=True)
            res["cold"] = merge_ranks(spawn(first_calls_job, a.world, keys, 3, device_kind=kind, timeout_s=1200))
        save()
        with temporary_env({**common, **folders(root, "warmed")}):
            print(f"warmup: autofuse.warmup_problems of the {len(keys)} problems", flush=True)
            reports = spawn(warmup_job, a.world, keys, device_kind=kind, timeout_s=1200)
            res["warmup"] = dict(reports[0], seconds=max(r["seconds"] for r in reports),
                                 compiles=max(r["compiles"] for r in reports))
            save()
            print("warm: first calls again, in a new job", flush=True)
            res["warm"] = merge_ranks(spawn(first_calls_job, a.world, keys, 5, device_kind=kind, timeout_s=1200))
        save()
    finally:
        if a.keep:
            print(f"folders kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    show(res)
    return 0 if res["summary"]["target_met"] else 2


if __name__ == "__main__":
    sys.exit(main())
