"""GPU check of `autofuse tune` (2 GPUs, under a minute): a short ag_gemm study in a scratch database.

Checks: baselines and trials are written in eager and graph mode with the GPU fingerprint; every OK
row matched the reference; `store.best` holds BSP and at least one fused variant and no config that
ever failed; the Optuna study has no RUNNING trial and one row per measured trial; a rerun resumes
the study and measures nothing new. Exits non-zero with the reasons on failure.
Run from the repository root: python3 scripts/gpu_check_tune.py
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch

from autofuse import environment, registry
from autofuse.op import Problem
from autofuse.store import Store
from autofuse.tune import default_storage

GPU = torch.cuda.is_available()  # without GPUs it checks the CPU emulation the same way
M = 1024 if GPU else 4
MODES = {"eager", "graph"} if GPU else {"eager"}
TRIALS = 3


def main() -> int:
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "check.db"
        cmd = [sys.executable, "-m", "autofuse", "tune", "--op", "ag_gemm", "--shapes", str(M), "--world", "2",
               "--trials", str(TRIALS), "--db", str(db)]
        t0 = time.monotonic()
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        took = time.monotonic() - t0
        print(first.stdout[-4000:])
        if first.returncode != 0:
            print(first.stderr[-4000:])
            return 1
        store = Store(db)
        fp = environment.fingerprint()
        rows = store.measurements(op="ag_gemm")
        problems = sorted({r["problem"] for r in rows})
        fails = []
        if fp["device_kind"] != ("cuda" if GPU else "cpu"):
            fails.append(f"fingerprint is not of this machine: {fp}")
        if {r["mode"] for r in rows} != MODES:
            fails.append(f"modes measured: {sorted({r['mode'] for r in rows})}")
        tol = registry.get("ag_gemm").tolerance
        bad_ok = [r for r in rows if r["ok"] and not r["rel_error"] <= tol(Problem.from_key(r["problem"]))]
        if bad_ok:
            fails.append(f"OK rows above tolerance: {bad_ok[:3]}")
        tune_rows = [r for r in rows if r["source"] == "tune"]
        written = {(r["study"], r["trial"]) for r in tune_rows}
        if len(written) != TRIALS * len(problems):
            fails.append(f"{len(written)} trials written, expected {TRIALS * len(problems)}")
        failed_cfgs = {(r["problem"], r["config_id"]) for r in rows if not r["ok"]}
        for mode in sorted(MODES):
            best = store.best(op="ag_gemm", mode=mode)
            variants = {r["variant"] for r in best}
            if "bsp" not in variants or not variants - {"bsp", "torch_symm"}:
                fails.append(f"{mode}: best holds {sorted(variants)}, expected bsp and a fused variant")
            if any((r["problem"], r["config_id"]) in failed_cfgs for r in best):
                fails.append(f"{mode}: a failed config is a candidate")
            for r in best:
                print(f"{mode:5s} {r['problem']} {r['variant']:10s} {r['median_us']:9.1f} us {r['config']}")
        url = default_storage(db)
        for s in optuna.get_all_study_summaries(url):
            trials = optuna.load_study(study_name=s.study_name, storage=url).get_trials(deepcopy=False)
            if any(t.state == optuna.trial.TrialState.RUNNING for t in trials):
                fails.append(f"{s.study_name}: a trial is left RUNNING")
        n_rows = len(store.measurements(op="ag_gemm"))
        store.close()
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        store = Store(db)
        if again.returncode != 0 or len(store.measurements(op="ag_gemm")) != n_rows:
            fails.append(f"rerun did not resume cleanly (rc {again.returncode}):\n{again.stdout[-2000:]}"
                         f"\n{again.stderr[-2000:]}")
        store.close()
    print(f"tune check: {len(problems)} problem(s), first run {took:.0f} s")
    for f in fails:
        print(f"FAIL: {f}")
    print("tune check:", "FAILED" if fails else "OK")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
