"""Benchmarks (`autofuse bench TARGET`): an op's variants against BSP and the bound, or an extra target.

TARGET is an op name (the op benchmark below) or one of `TARGETS` (an extra benchmark in its own
module). Every target follows one contract, so the command treats them alike:

    run(options: BenchOptions) -> dict
        Called once in the command's process. Spawns its own ranks where it needs several
        (`autofuse.comm.world.spawn`) and returns rank 0's result: JSON-able data (no NaN needed: the
        writer turns non-finite floats into null), with a "rows" list (one dict per measured case).
        Optional keys the command reads: "sweep" (the problem set actually run), "world" (ranks),
        "device_kind" ("cuda" | "cpu"), "notes" (list of one-line strings printed after the tables).
        While `options.progress` is true it prints a progress line to stdout per measurement (not
        per problem) as the work goes; with it false (`--quiet`, `--json`) it prints nothing.
        It never writes files: the command writes the JSON.
    render(result: dict, console) -> None
        Prints the result for people on `console` (a rich Console with markup off: foreign text
        prints as written) readable at 80 columns (split or wrap wide tables, no truncation).
    DEFAULT_SWEEP = {"cuda": ..., "cpu": ...} and WORLD (optional module constants)
        The sweep run when `--sweep` is not given, and the world size of a target that runs a fixed
        one: they name the default output file before the run starts (`planned_out`).

The command adds "target", "date", "fingerprint" and "options" to the result and writes it to
`options.out`, or by default to `planned_out(...)`: ./autofuse-out/bench-TARGET-SWEEP-wWORLD-DATE.json
in the current directory; as with every command, an existing file stops the run before any work
unless `options.force`.

The op benchmark: for each problem of `op.sweep(kind, world)`, each available variant is measured
at each of its known-good configs (`variant.defaults(problem)`), correctness-checked first; the
fastest correct config per variant is reported. The pieces of the op's bound (`op.bound`,
e.g. the all-gather alone and the matmul alone) are timed in the same run, and bound = max(pieces);
best, x BSP, x alt, bound and ceiling are those of `autofuse.measure.compare`. On CPU the timings are the
Triton interpreter's and gloo's, not a GPU's: they show that every variant runs, not how fast it
would be, so no speedup is reported. With `options.profile`, each measured variant's best config
is then profiled per mode (`autofuse.bench.kernel_profile`): its rows gain a "profile" key
{variant: per-kernel breakdown} and `render` prints a kernel table per problem.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from autofuse.measure.compare import INTERPRETED_NOTE

# The extra targets: name -> module that implements run/render (see the module docstring).
TARGETS: dict[str, str] = {
    "collectives": "autofuse.bench.bench_collectives",
    "gemm_core": "autofuse.bench.bench_gemm_core",
    "layer": "autofuse.bench.bench_layer",
    "moe": "autofuse.bench.bench_moe",
    "train_layer": "autofuse.bench.bench_train_layer",
    "train_model": "autofuse.bench.bench_train_model",
}
OUT_PATTERN = "autofuse-out/bench-TARGET-SWEEP-wWORLD-DATE.json"
CPU_NOTE = INTERPRETED_NOTE


class BenchTargetMissing(LookupError):
    """A bench target whose module is not part of this installation (one line: which and why)."""


@dataclass
class BenchOptions:
    """What `autofuse bench` passes to a target's `run` (the command line, parsed; None = the target's default).

    target: op name or a key of TARGETS. sweep: problem set name (op targets: gpu, llama70b, cpu;
    None: gpu with GPUs, else cpu). variants: variant names to run (None: all available). modes:
    timing modes (None: every mode this machine has: eager and graph on GPUs, eager on CPU).
    shapes: the --shapes values as given (the op benchmark reads comma-separated M, or B for
    flash_decode, values; other targets document their own syntax). reps: timed batches per
    measurement (median taken). limit: only the first N problems. world: ranks (None: every local
    GPU, or 2 CPU ranks). out: JSON path (None: `default_out`). device_kind: "cuda" or "cpu"
    ("" = detect). force: replace an existing output file. progress: print a line per measurement.
    profile: op targets only: after measuring, profile each variant's best config per kernel.
    dtype: the input dtype of targets that take one (gemm_core: bf16 or fp8; None: bf16).
    search: gemm_core's config set, defaults or wide (None: defaults).
    layers: train_model only: decoder layers of the model (None: 4 on GPUs, 2 on CPU).
    tokens: moe's token counts per rank, comma-separated items (None: its default list).
    skew: moe's routing skew, percent of the rows on rank 0's experts (None or 0: even).
    """

    target: str
    sweep: str | None = None
    variants: list[str] | None = None
    modes: list[str] | None = None
    shapes: list[str] | None = None
    reps: int = 20
    limit: int | None = None
    world: int | None = None
    out: Path | None = None
    device_kind: str = ""
    force: bool = False
    progress: bool = True
    profile: bool = False
    dtype: str | None = None
    search: str | None = None
    layers: int | None = None
    tokens: list[str] | None = None
    skew: int | None = None

    def resolved(self) -> "BenchOptions":
        """A copy with device_kind and world filled in for this machine."""
        from autofuse.comm.world import default_device_kind, gpu_count

        kind = self.device_kind or default_device_kind()
        world = self.world if self.world is not None else (gpu_count() if kind == "cuda" else 2)
        return BenchOptions(**{**asdict(self), "device_kind": kind, "world": world})


def is_op(target: str) -> bool:
    from autofuse.core import registry

    return target in registry.names()


def target_names() -> list[str]:
    """Every name `autofuse bench` accepts: the registered ops, then the extra targets."""
    from autofuse.core import registry

    return list(registry.names()) + sorted(TARGETS)


def load_target(target: str) -> ModuleType:
    """The module implementing `target` (this module for an op); BenchTargetMissing if it is absent."""
    if is_op(target):
        return importlib.import_module(__name__)
    if target not in TARGETS:
        raise BenchTargetMissing(f"unknown bench target {target!r}; available: {', '.join(target_names())}")
    name = TARGETS[target]
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        raise BenchTargetMissing(f"bench target {target!r} is not available in this installation "
                                 f"(its module {name} is missing)")
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise BenchTargetMissing(f"bench target {target!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    missing = [f for f in ("run", "render") if not callable(getattr(module, f, None))]
    if missing:
        raise BenchTargetMissing(f"bench target {target!r}: module {name} lacks {', '.join(missing)}()")
    return module


def planned_out(module: ModuleType, options: BenchOptions, date: str | None = None) -> Path:
    """The default output of a run, known before it starts (so an existing file stops it before any work):
    the target's sweep (`options.sweep`, else the module's DEFAULT_SWEEP for this device kind, else
    'default'; an op's is gpu or cpu) and world size (the module's WORLD if it runs a fixed one)."""
    o = options.resolved()
    sweeps = getattr(module, "DEFAULT_SWEEP", {})
    if module.__name__ == __name__:
        sweeps = {"cuda": "gpu", "cpu": "cpu"}
    return default_out(o.target, o.sweep or sweeps.get(o.device_kind), getattr(module, "WORLD", None) or o.world, date)


def default_out(target: str, sweep: str | None, world: int | None, date: str | None = None) -> Path:
    """./autofuse-out/bench-TARGET-SWEEP-wWORLD-DATE.json (SWEEP 'default' when the target has none)."""
    from autofuse.core.settings import OUT_DIR

    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return OUT_DIR / f"bench-{target}-{sweep or 'default'}-w{world if world is not None else 0}-{date}.json"


# ---------------------------------------------------------------------------------------------
# The op benchmark


@dataclass
class BenchRow:
    """One problem in one mode: best latency per variant, the bound and its pieces."""

    problem: Any
    mode: str
    best: dict[str, float] = field(default_factory=dict)
    config: dict[str, dict] = field(default_factory=dict)
    pieces: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    pieces_bw: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, dict] | None = None

    @property
    def bound(self) -> float:
        return max(self.pieces.values()) if self.pieces else math.nan

    def fastest(self, among: Sequence[str]) -> tuple[str, float]:
        """(variant, us) of the fastest of `among` measured here, ("-", nan) if none."""
        cands = [(v, t) for v, t in self.best.items() if v in among]
        return min(cands, key=lambda x: x[1]) if cands else ("-", math.nan)


def parse_shapes(shapes: Sequence[str] | None) -> list[int] | None:
    """The op benchmark's --shapes: comma-separated M (or B) values, repeatable."""
    if not shapes:
        return None
    out = []
    for item in shapes:
        for s in item.split(","):
            s = s.strip()
            if not s:
                continue
            if not s.isdigit():
                raise ValueError(f"--shapes takes M (or B) values such as 64,128, not {s!r}")
            out.append(int(s))
    return out or None


def _config_text(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items())) or "default"


def bench_rank(world, op_name: str, kind: str, variants: Sequence[str] | None, modes: Sequence[str] | None,
               reps: int, limit: int | None, shapes: Sequence[int] | None, progress: bool = True,
               profile: bool = False) -> dict[str, Any]:
    """Run on every rank; returns plain data (rank 0's is printed). Rank 0 prints one line per measurement
    (and, with `profile`, one per profile)."""
    from autofuse.core import registry
    from autofuse.core.modes import supported as supported_modes
    from autofuse.measure.timing import measure, time_fn

    op = registry.get(op_name)
    problems = op.sweep(kind, world.size)
    if shapes:
        problems = [p for p in problems if p.get("M", p.get("B")) in set(shapes)]
    if limit:
        problems = problems[:limit]
    modes = tuple(modes or supported_modes(world.device.type))
    names = [v for v in op.variants if (variants is None or v in variants) and op.variants[v].available(world)]
    plan = [(p, v, c) for p in problems for v in names for c in op.variants[v].defaults(p)]
    rows: list[BenchRow] = []
    raw: list[dict] = []
    done = 0
    say = world.rank == 0 and progress
    for i, problem in enumerate(problems):
        per_mode = {m: BenchRow(problem, m, profiles={} if profile else None) for m in modes}
        for vname in names:
            for config in [c for p, v, c in plan if p is problem and v == vname]:
                got = measure(world, op, problem, vname, config, modes=modes, reps=reps)
                done += 1
                for ms in got:
                    raw.append(ms.row())
                    _keep_best(per_mode[ms.mode], ms)
                if say:
                    times = "; ".join(f"{ms.mode} {ms.median_us:.1f} us" if ms.ok else
                                      f"{ms.mode} failed: {(ms.error or 'failed').splitlines()[0][:80]}" for ms in got)
                    print(f"[{done}/{len(plan)}] problem {i + 1}/{len(problems)} {problem.key} {vname} "
                          f"{_config_text(config)}: {times}", flush=True)
            if profile:
                _profile_best(world, op, problem, vname, per_mode, say)
        if op.bound is not None:
            pieces = op.bound(world, problem, 0)
            for mode in modes:
                for pname, fn in pieces.items():
                    per_mode[mode].pieces[pname] = time_fn(world, fn, mode, reps=reps).median_us
            del pieces
            if say:
                print(f"  bound of {problem.key}: " + "; ".join(
                    f"{m} {per_mode[m].bound:.1f} us" for m in modes), flush=True)
        if op.bytes_read is not None and op.copy_rate is not None:
            # HBM rate in the same run: a device copy of the same bytes (it reads and writes them).
            copy = op.copy_rate(world, problem)
            nbytes = op.bytes_read(problem)
            for mode in modes:
                t_copy = time_fn(world, copy, mode, reps=reps).median_us
                row = per_mode[mode]
                row.pieces_bw = {"bytes": nbytes, "copy_us": t_copy, "copy_GBps": 2 * nbytes / t_copy / 1e3}
                if "local" in row.pieces:
                    row.pieces_bw["local_GBps"] = nbytes / row.pieces["local"] / 1e3
                    row.pieces_bw["local_vs_copy"] = row.pieces_bw["local_GBps"] / row.pieces_bw["copy_GBps"]
            del copy
        rows.extend(per_mode.values())
    from autofuse.measure.compare import interpreted

    return {"rows": [_row_dict(r, op, interpreted(world.device.type)) for r in rows], "raw": raw, "variants": names,
            "modes": list(modes)}


def _profile_best(world, op: Any, problem: Any, vname: str, per_mode: dict[str, BenchRow], say: bool) -> None:
    """Profile `vname`'s fastest correct config in each mode it was measured in (every rank, in lockstep);
    the breakdown goes into that mode's row. A variant with no correct config is not profiled."""
    from autofuse.bench.kernel_profile import profile_variant

    for mode, row in per_mode.items():
        if vname not in row.best:
            continue
        got = profile_variant(world, op, problem, vname, row.config[vname], mode, row.best[vname])
        row.profiles[vname] = got
        if say:
            print(f"  profile of {vname} on {problem.key}, {mode}: {_profile_text(got)}", flush=True)


def _profile_text(got: dict[str, Any]) -> str:
    """One line of a profile: busy vs measured time per call and the top kernel, or why it failed."""
    if "error" in got:
        return f"failed: {got['error']}"
    top = got["kernels"][0] if got["kernels"] else None
    return (f"busy {_f(got['busy_us'], 1)} of {_f(got['latency_us'], 1)} us measured, "
            f"{len(got['kernels'])} kernels" + (f", top {top['name']} {top['share']:.0%}" if top else ""))


def _keep_best(row: BenchRow, ms: Any) -> None:
    if not ms.ok:
        row.failures.setdefault(ms.variant, ms.error.splitlines()[0][:160] if ms.error else "failed")
        return
    if ms.median_us < row.best.get(ms.variant, math.inf):
        row.best[ms.variant] = ms.median_us
        row.config[ms.variant] = ms.config
        row.failures.pop(ms.variant, None)


def _row_dict(row: BenchRow, op: Any, is_interpreted: bool) -> dict[str, Any]:
    """The row as JSON: every variant's best time (`us`) and config, the bound's pieces, and the numbers of
    autofuse.measure.compare (best, x BSP, x alt, autofuse's own best vs BSP, bound, ceiling; no ratio for the
    interpreter), plus the best variant of each family."""
    from autofuse.measure.compare import compare

    by_family = {}
    for family in ("peer", "hybrid", "fused"):
        v, t = row.fastest([n for n, var in op.variants.items() if var.family == family])
        if v != "-":
            by_family[family] = {"variant": v, "us": t}
    bound = row.bound if row.bound == row.bound else None
    return {
        "problem": row.problem.key, **row.problem.as_dict(), "mode": row.mode,
        "us": row.best, "config": row.config, "pieces_us": row.pieces,
        **compare(op, row.best, bound, is_interpreted).as_dict(), "best_by_family": by_family,
        "failures": row.failures, "bandwidth": row.pieces_bw,
        **({"profile": row.profiles} if row.profiles is not None else {}),
    }


def run(options: BenchOptions) -> dict[str, Any]:
    """The op benchmark on `options.world` ranks (the contract's `run` for every op target)."""
    from autofuse.core import registry
    from autofuse.comm.world import spawn

    o = options.resolved()
    op = registry.get(o.target)
    sweep = o.sweep or ("gpu" if o.device_kind == "cuda" else "cpu")
    if o.variants:
        unknown = sorted(set(o.variants) - set(op.variants))
        if unknown:
            raise ValueError(f"{o.target} has no variant {', '.join(unknown)}; it has {', '.join(op.variants)}")
    results = spawn(bench_rank, o.world, o.target, sweep, o.variants, o.modes, o.reps, o.limit,
                    parse_shapes(o.shapes), o.progress, o.profile, device_kind=o.device_kind, timeout_s=3600)
    result = dict(results[0], op=o.target, sweep=sweep, world=o.world, device_kind=o.device_kind)
    if o.device_kind == "cpu":
        result["notes"] = [CPU_NOTE]
    return result


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def render(result: dict[str, Any], console: Any) -> None:
    """One table per mode (the problem parts that vary as columns, the fixed ones in the title): each variant's
    latency, the best, x BSP, x alt, the bound and the ceiling (autofuse.measure.compare), then the geomeans; the
    CPU emulation's tables hold latencies only. With profiles, a kernel table per problem after its mode's."""
    from autofuse.bench.tables import LEGEND, print_split_table, split_problems
    from autofuse.measure.compare import geomean
    from autofuse.bench.kernel_profile import render_profile

    op_name = result.get("op") or result.get("target", "?")
    for mode in result["modes"]:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        interp = any(r["interpreted"] for r in rows)
        key_cols, cells, fixed = split_problems([r["problem"] for r in rows])
        alt = any(r["alternative"] for r in rows)
        cols = ["best"] + ([] if interp else ["x BSP"] + (["x alt", "own", "own/alt"] if alt else [])
                           + ["bound", "ceiling"])
        body = []
        for r in rows:
            times = [f"{r['us'][v]:.1f}" if v in r["us"] else ("fail" if v in r["failures"] else "-")
                     for v in result["variants"]]
            extra = {"best": r["best"] or "-", "x BSP": _f(r["speedup_vs_bsp"]),
                     "x alt": _f(r["speedup_vs_alternative"]), "own": r.get("own") or "-",
                     "own/alt": _f(r.get("own_vs_alternative")), "bound": _f(r["bound_us"], 1),
                     "ceiling": _f(r["ceiling"])}
            body.append([*cells[r["problem"]], *times, *[extra[c] for c in cols]])
        print_split_table(console, f"{op_name} {fixed}, {mode} mode: us per call (median, rank-max)",
                          key_cols, [*result["variants"], *cols], body)
        bw = [r for r in rows if (r.get("bandwidth") or {}).get("local_GBps")]
        if bw and not interp:
            body = [[*cells[r["problem"]], f"{r['bandwidth']['local_GBps']:.0f}", f"{r['bandwidth']['copy_GBps']:.0f}",
                     f"{r['bandwidth']['local_vs_copy']:.2f}"] for r in bw]
            print_split_table(console, f"{op_name}, {mode} mode: local kernel bandwidth vs a device copy",
                              key_cols, ["local GB/s", "copy GB/s (read+write)", "local / copy"], body)
        if not interp:
            console.print(f"{mode}: geomean over {len(rows)} problems: x BSP of the best "
                          f"{_f(geomean(r['speedup_vs_bsp'] for r in rows), 3)}, of autofuse's own best "
                          f"{_f(geomean(r['own_vs_bsp'] for r in rows), 3)}"
                          + (f"; x alt {_f(geomean(r['speedup_vs_alternative'] for r in rows), 3)}; own/alt "
                             f"{_f(geomean(r.get('own_vs_alternative') for r in rows), 3)} (below 1: torch's ops beat "
                             "autofuse's own kernels)" if alt else ""))
            for family in ("hybrid", "fused"):
                ups = [r["us"]["bsp"] / r["best_by_family"][family]["us"] for r in rows
                       if family in r.get("best_by_family", {}) and "bsp" in r["us"]]
                if ups:
                    console.print(f"{mode}: geomean of the best {family} variant over BSP = {_f(geomean(ups), 3)}x "
                                  f"over {len(ups)} problems")
        fails = {(r["problem"], v): why for r in rows for v, why in r["failures"].items()}
        for (p, v), why in list(fails.items())[:10]:
            console.print(f"  {v} failed on {p}: {why}", style="yellow")
        for r in rows:
            if r.get("profile"):
                render_profile(r, result.get("device_kind", ""), console)
    if not any(r["interpreted"] for r in result["rows"]):
        console.print(LEGEND)
    for line in result.get("notes", []):
        console.print(line, style="yellow")


def _finite(x: Any) -> Any:
    """JSON without NaN/inf: non-finite floats become null (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def report(result: dict[str, Any], options: BenchOptions) -> dict[str, Any]:
    """The JSON document: the target's result plus target, date, fingerprint and the options."""
    from autofuse.measure import environment

    opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    doc = {"target": options.target, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "fingerprint": environment.fingerprint(options.device_kind or None), "options": opts, **result}
    if "op" in result:
        doc.setdefault("sweep", result.get("sweep"))
    return doc


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(_finite(doc), indent=1, default=str, allow_nan=False) + "\n"
