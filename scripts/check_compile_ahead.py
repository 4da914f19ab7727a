"""Does compiling ahead make the ranks' first calls Triton cache hits? (GPU diagnostic for the tuner)

    python scripts/check_compile_ahead.py [--world 2] [--ops ag_gemm,gemm_rs,gemm_ar,flash_decode]

For the first problem of each op's default sweep and every tunable variant's first default config:
1. this process compiles each config as a compile-ahead worker does (`tuning.compile_ahead.compile_config`,
   a fresh TRITON_CACHE_DIR), logging every Triton cache key it computes;
2. `world` ranks then build and check the same configs as the tuner does (`measure.timing.build_checked`),
   logging theirs.
A rank's key that the worker never computed is a compile the GPUs waited for. For each such key the
script prints what differs from the worker's key of the same kernel (Triton's source hash inputs:
specialisation attributes, constants, signature; options; environment). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

LOG: list[dict[str, Any]] = []


def _install(role: str) -> None:
    """Record, per Triton compile of this process, the kernel, its cache hash and the hash's inputs."""
    import triton.compiler.compiler as cc

    orig_hash = cc.ASTSource.hash
    last: dict[str, Any] = {}

    def src_hash(self: Any) -> str:
        h = orig_hash(self)
        last.update(name=getattr(self, "name", "?"), attrs=str(getattr(self, "attrs", "")),
                    constants=str(sorted((str(k), str(v)) for k, v in (getattr(self, "constants", {}) or {}).items())),
                    signature=str(getattr(self, "signature", "")), src_hash=h)
        return h

    orig_mgr = cc.get_cache_manager

    def get_cache_manager(key: str) -> Any:
        mgr = orig_mgr(key)
        hit = bool(mgr.get_file(f"__grp__{last.get('name', '')}.json")) if last else None
        LOG.append({"role": role, "cache_hash": key, "disk_hit": hit, **last})
        return mgr

    cc.ASTSource.hash = src_hash
    cc.get_cache_manager = get_cache_manager


def _targets(ops: list[str], world: int) -> list[tuple[str, str, str, dict]]:
    from autofuse.core import registry
    from autofuse.tuning.schedule import spread

    out = []
    for name in ops:
        op = registry.get(name)
        problems = op.sweep("default", world)
        problem = problems[spread(len(problems))[0]]
        for v, variant in op.variants.items():
            if variant.family == "bsp" or not variant.tunable:
                continue
            defaults = [c for c in variant.defaults(problem) if variant.check(problem, c) is None]
            if defaults:
                out.append((name, problem.key, v, dict(defaults[0])))
    return out


def _rank(world: Any, targets: list, cache_dir: str) -> list[dict]:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    _install(f"rank{world.rank}")
    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import build_checked

    for name, key, variant, config in targets:
        runner, why, _ = build_checked(world, registry.get(name), Problem.from_key(key), variant, config, seed=0)
        if runner is None:
            LOG.append({"role": f"rank{world.rank}", "name": f"{name}/{variant}", "error": why[:200]})
    return LOG


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ops", default="ag_gemm,gemm_rs,gemm_ar,flash_decode")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "compile-ahead-check.json"))
    args = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="triton-cache-check-")
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    _install("worker")
    from autofuse.comm.world import spawn
    from autofuse.tuning.compile_ahead import compile_config

    targets = _targets(args.ops.split(","), args.world)
    for name, key, variant, config in targets:
        try:
            compile_config(name, key, variant, config, "cuda")
        except Exception as exc:  # noqa: BLE001 - reported
            LOG.append({"role": "worker", "name": f"{name}/{variant}", "error": f"{type(exc).__name__}: {exc}"[:200]})
    worker = [e for e in LOG if e["role"] == "worker"]
    ranks = [e for r in spawn(_rank, args.world, targets, cache_dir, timeout_s=600) for e in r]
    seen = {e.get("cache_hash") for e in worker}
    misses = [e for e in ranks if e.get("cache_hash") and e["cache_hash"] not in seen]
    report = []
    for e in misses:
        same = [w for w in worker if w.get("name") == e.get("name")]
        diff = {}
        if same:
            w = same[0]
            diff = {k: (w.get(k), e.get(k)) for k in ("attrs", "constants", "signature", "src_hash") if w.get(k) != e.get(k)}
        report.append({"rank": e["role"], "kernel": e.get("name"), "disk_hit": e.get("disk_hit"),
                       "worker_compiled_it": bool(same), "differs": diff})
    errors = [e for e in worker + ranks if "error" in e]
    with open(args.out, "w") as f:
        json.dump({"targets": targets, "worker": worker, "ranks": ranks, "misses": report, "errors": errors}, f, indent=1)
    print(f"targets {len(targets)}; worker compiles {len(worker)}; rank cache lookups {len(ranks)}; "
          f"rank keys the worker never made {len(misses)}; errors {len(errors)}")
    for r in report[:12]:
        print(r["rank"], r["kernel"], "disk_hit", r["disk_hit"], "worker had kernel", r["worker_compiled_it"])
        for k, (a, b) in r["differs"].items():
            print(f"   {k}: worker {str(a)[:300]}\n   {k}: rank   {str(b)[:300]}")
    for e in errors[:6]:
        print("error", e)


if __name__ == "__main__":
    main()
