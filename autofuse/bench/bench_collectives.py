"""`autofuse bench collectives`: every heap collective against the collective library, per message size.

For each collective (all_gather, reduce_scatter, all_reduce), each message size per rank (default 4 KB
to 64 MB, x4 steps) and each timing mode (graph: CUDA-graph replay; eager), it times the library's
collective (NCCL on GPUs: all_gather_single, reduce_scatter_single, all_reduce; gloo on CPU) and
every heap implementation (all_gather: push, inbox, pull, ce; reduce_scatter: sm, ce; all_reduce:
one_shot, two_shot, ce, and ll: the data-as-flag all-reduce of autofuse/comm/lowlatency.py, up to its
size limit) at a few configs (COMM_SMS chosen by size), keeping each implementation's best. On GPUs the
all-reduce also times the alternative users run instead, torch's symmetric-memory one-shot and two-shot
all-reduces (`own/alt`: the fastest of them over autofuse's fastest). Every config is first checked against the library's result (the gather bit for bit, the sums
within the dtype's rounding; all_reduce also bitwise equal on every rank); a wrong or failing config
is reported, never timed. Latency in us (median, rank-max), algorithm bandwidth (bytes per rank / time)
and bus bandwidth (NCCL's convention: all_gather (W-1)/W * W * bytes, reduce_scatter (W-1)/W * bytes,
all_reduce 2 (W-1)/W * bytes, per time: on two ranks the bytes each rank sends per direction).

Contract (autofuse/bench/bench.py): `run(options) -> dict` with "rows" (one per kind, size, mode,
implementation), `render(result, console)`. Options read (getattr, defaults in brackets): world
[every GPU, 2 on CPU], modes [graph and eager on GPUs, eager on CPU], shapes [sizes: "4K,64K,16M"
etc.], variants [kinds or implementations to keep: "all_gather", "push", "all_reduce.two_shot"],
reps [20], device_kind [detect], progress [True]. On two H200 the default run takes about 3 minutes
(Triton compiles included). On CPU it runs a tiny version under the Triton interpreter with gloo,
and says so: those timings are the interpreter's, not a GPU's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from autofuse.comm import lowlatency

if TYPE_CHECKING:
    from autofuse.comm.world import World

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
IMPLS = {"all_gather": ("push", "inbox", "pull", "ce"), "reduce_scatter": ("sm", "ce"),
         "all_reduce": ("one_shot", "two_shot", "ce", "ll")}
ALTERNATIVES = {"all_reduce": ("torch_one_shot", "torch_two_shot")}  # torch's symmetric memory (CUDA only)
GPU_SIZES = tuple(4 << (10 + 2 * i) for i in range(8))  # 4 KB .. 64 MB per rank
CPU_SIZES = (4 << 10, 16 << 10)
CPU_NOTE = ("CPU emulation: the Triton interpreter and gloo on CPU ranks, not GPU timings; they show that every "
            "collective runs and matches the library, not which is faster on a GPU.")
TARGETS = ("targets (issue 12, two H200, bf16, graph): all_gather <= 6 us at <= 64 KB per rank (NCCL ~9.3 us), "
           ">= 340 GB/s per direction at >= 16 MB; all_reduce <= 8 us at <= 256 KB")


def parse_sizes(shapes: Sequence[str] | None) -> list[int] | None:
    """'4K,64K' '16M' '1048576' -> bytes per rank (None when none given)."""
    if not shapes:
        return None
    out = []
    for item in shapes:
        for s in str(item).split(","):
            s = s.strip().upper().removesuffix("B")
            if not s:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            digits = s[:-1] if s[-1] in "KMG" else s
            if not digits.isdigit() or int(digits) <= 0:
                raise ValueError(f"collectives --shapes takes message sizes per rank such as 4K,64K,16M, not {s!r}")
            out.append(int(digits) * mult)
    return out or None


def message_shape(kind: str, nbytes: int, itemsize: int, world: int, max_cols: int) -> tuple[int, int]:
    """(rows, cols) of about `nbytes` per rank; rows a multiple of the world size for reduce_scatter."""
    elems = max(1, nbytes // itemsize)
    need = world if kind == "reduce_scatter" else 1
    cols = max(1, min(max_cols, elems // need))
    rows = max(need, (elems // cols) // need * need)
    return rows, cols


def candidates(kind: str, nbytes: int, device_type: str) -> dict[str, list[dict]]:
    """The configs tried per implementation at this message size (the best one is reported)."""
    if device_type != "cuda":
        small = {"COMM_SMS": 2, "BLOCK": 1024, "num_warps": 4}
        sms: tuple[int, ...] = (2,)
        block, warps = 1024, 4
    else:
        sms = ((4, 16) if nbytes <= 64 << 10 else (16, 32) if nbytes <= 1 << 20 else (32, 64) if nbytes <= 4 << 20
               else (64, 128))  # 128 programs: the all-gather's 344 GB/s at 64 MB (scripts/collective_sweep.py)
        block, warps = (4096 if nbytes <= 1 << 20 else 8192), 8
        small = {}
    ce = {"ENGINE": "ce", "COMM_SMS": 1, "BLOCK": 4096, "num_warps": 4}
    sm = [{"ENGINE": "sm", "COMM_SMS": s, "BLOCK": block, "num_warps": warps, **small} for s in sms]
    if device_type == "cuda" and nbytes > 1 << 20:  # pipelined chunks: copies and sums overlap the transfer
        sm.append(dict(sm[-1], CHUNKS=4))
    if kind == "all_gather":
        out = {a: [dict(c, ALGO=a) for c in sm] for a in ("push", "inbox", "pull")}
        out["ce"] = [dict(ce, ALGO="push")]
    elif kind == "reduce_scatter":
        out = {"sm": sm, "ce": [ce]}
    else:
        out = {a: [dict(c, ALGO=a) for c in sm] for a in ("one_shot", "two_shot")}
        out["ce"] = [dict(ce, ALGO="one_shot")]
        if nbytes <= lowlatency.MAX_BYTES:
            ll_sms = (2,) if device_type != "cuda" else (8, 16, 32) if nbytes <= 64 << 10 else (16, 32, 64)
            out["ll"] = [{"COMM_SMS": s, "BLOCK": 256 if device_type != "cuda" else 1024, "num_warps": 4}
                         for s in ll_sms]
    return out


def _wanted(kind: str, impl: str, variants: Sequence[str] | None) -> bool:
    if not variants:
        return True
    return kind in variants or impl in variants or f"{kind}.{impl}" in variants


def bus_factor(kind: str, world: int) -> float:
    if kind == "all_gather":
        return world - 1.0
    if kind == "reduce_scatter":
        return (world - 1.0) / world
    return 2.0 * (world - 1.0) / world


class Library:
    """The collective library's version of one collective on fixed buffers (NCCL or gloo)."""

    def __init__(self, world: World, kind: str, x: torch.Tensor):
        import torch.distributed as dist

        from autofuse.comm.world import all_gather_single, reduce_scatter_single

        self.fn = {"all_gather": all_gather_single, "reduce_scatter": reduce_scatter_single}.get(kind, dist.all_reduce)
        self.group, self.kind, self.x = world.group, kind, x
        w = world.size
        if kind == "all_gather":
            self.out = torch.empty((w * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        elif kind == "reduce_scatter":
            self.out = torch.empty((x.shape[0] // w, x.shape[1]), dtype=x.dtype, device=x.device)
        else:
            self.out = torch.empty_like(x)

    def __call__(self) -> torch.Tensor:
        if self.kind == "all_reduce":
            self.out.copy_(self.x)
            self.fn(self.out, group=self.group)
        else:
            self.fn(self.out, self.x, group=self.group)
        return self.out


def _bits(y: torch.Tensor | None) -> int:
    if y is None:
        return -1
    return int(y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32).to(torch.int64).sum().item())


def _verify(world: World, kind: str, coll: Any, x: torch.Tensor, expected: torch.Tensor, tol: float) -> str:
    """'' if `coll` matches the library on every rank (agreed), else why not. Every rank runs the
    same host collectives whatever happened locally (mismatched collectives would hang)."""
    import torch.distributed as dist

    why, y = "", None
    try:
        y = coll(x)
        coll.check()
        if kind == "all_gather":
            if not torch.equal(y, expected):
                why = "differs from the library's all-gather"
        else:
            ref = expected.double()
            err = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err <= tol:
                why = f"rel error {err:.3g} > {tol:.3g}"
    except Exception as exc:  # a config that fails is a reported failure, not a failed bench
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if kind == "all_reduce":
        bits = torch.tensor([_bits(y if not why else None)] * 2, dtype=torch.int64, device=world.device)
        bits[1] = -bits[1]
        dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=world.group)  # [max, -min]
        if not why and int(bits[0]) != -int(bits[1]):
            why = "ranks returned different bits"
    if world.rank_max(1.0 if why else 0.0) > 0 and not why:
        why = "failed on another rank"
    return why


def collective_call(kind: str, coll: Any, x: torch.Tensor) -> Callable[[], Any]:
    """One call of a built heap collective on `x`, as it is timed: the all-gather into its own
    buffer, the others into one preallocated output."""
    if kind == "all_gather":
        return lambda: coll(x)
    out = torch.empty(x.shape if kind == "all_reduce" else coll.out_shape, dtype=x.dtype, device=x.device)
    return lambda: coll(x, out=out)


def time_config(world: World, kind: str, x: torch.Tensor, expected: torch.Tensor, config: dict,
                modes: Sequence[str], reps: int, tol: float, name: str = "bench",
                impl: str = "") -> tuple[dict[str, float], str]:
    """Check one heap config of collective `kind` on `x` against the library's `expected` result,
    then time it in each of `modes`: ({mode: median us, rank-max}, '') or ({mode: nan}, why it was
    refused, failed or wrong). A failed config's workspaces are rebuilt. Every rank calls it alike. `impl`
    "ll" builds the low-latency all-reduce (autofuse.comm.lowlatency) instead of a collectives one."""
    from autofuse.comm import collectives as C
    from autofuse.measure.timing import time_fn

    failed = {mode: math.nan for mode in modes}
    rows, cols = x.shape
    ll = impl == "ll"  # autofuse.comm.lowlatency's all-reduce, its own config keys
    why = lowlatency.check(world, rows, cols, x.dtype, config) if ll else C.check(kind, world, rows, cols, x.dtype, config)
    if why:
        return failed, why
    try:
        coll = (lowlatency.all_reduce(world, rows, cols, x.dtype, config, name=f"{name}.ll") if ll
                else C.build(kind, world, rows, cols, x.dtype, config, name=name))
    except Exception as exc:  # e.g. HeapFull: the same on every rank
        return failed, f"{type(exc).__name__}: {exc}"
    why = _verify(world, kind, coll, x, expected, tol)
    if why:
        world.sync()
        for ws in coll.workspaces:
            ws.rebuild()
        return failed, why
    fn = collective_call(kind, coll, x)
    us = {mode: time_fn(world, fn, mode, reps=reps).median_us for mode in modes}
    coll.check()
    return us, ""


def bench_rank(world: World, kinds: Sequence[str], sizes: Sequence[int], modes: Sequence[str], reps: int,
               variants: Sequence[str] | None, progress: bool) -> dict[str, Any]:
    """Every rank runs this; rank 0's result is the bench's."""
    from autofuse.measure.timing import time_fn

    cuda = world.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    say = progress and world.rank == 0
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(1234 + world.rank)
    w = world.size

    def record(kind, nbytes, shape, mode, impl, config, us, error=""):
        row = {"kind": kind, "bytes": nbytes, "rows": shape[0], "cols": shape[1], "dtype": str(dtype).split(".")[-1],
               "world": w, "mode": mode, "impl": impl, "config": config, "us": us, "error": error}
        if us == us and us > 0:
            row["algbw_GBps"] = nbytes / us / 1e3
            row["busbw_GBps"] = nbytes * bus_factor(kind, w) / us / 1e3
        rows.append(row)
        if say:
            what = f"{us:.1f} us" if not error else f"failed: {error}"
            print(f"{kind} {nbytes >> 10} KB {mode} {impl} {config_text(config)}: {what}", flush=True)

    for kind in kinds:
        for size in sizes:
            shape = message_shape(kind, size, dtype.itemsize, w, 8192 if cuda else 256)
            nbytes = shape[0] * shape[1] * dtype.itemsize
            x = torch.randn(shape, generator=g).to(dtype).to(world.device)
            lib = Library(world, kind, x)
            expected = lib().clone()
            for mode in modes:
                record(kind, nbytes, shape, mode, "nccl" if cuda else "gloo", {},
                       time_fn(world, lib, mode, reps=reps).median_us)
            if cuda and kind in ALTERNATIVES:
                for impl, fn in torch_all_reduces(world, x).items():
                    if _wanted(kind, impl, variants):
                        for mode in modes:
                            record(kind, nbytes, shape, mode, impl, {}, time_fn(world, fn, mode, reps=reps).median_us)
            for impl, configs in candidates(kind, nbytes, world.device.type).items():
                if not _wanted(kind, impl, variants):
                    continue
                for config in configs:
                    us, why = time_config(world, kind, x, expected, config, modes, reps, tol, name=f"bench.{kind}",
                                          impl=impl)
                    for mode in modes:
                        record(kind, nbytes, shape, mode, impl, config, us[mode], why)
    return {"rows": rows, "kinds": list(kinds), "sizes": list(sizes), "modes": list(modes), "world": w,
            "dtype": str(dtype).split(".")[-1]}


def torch_all_reduces(world: World, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """torch's symmetric-memory one-shot and two-shot all-reduces of `x`, as users run them (x copied once
    into a symmetric buffer; the one-shot writes a separate output, the two-shot reduces in place)."""
    import torch.distributed._symmetric_memory as symm

    from autofuse.comm.heap import torch_symm_group

    group = torch_symm_group(world)
    buf = symm.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    symm.rendezvous(buf, group)
    buf.copy_(x)
    out = torch.empty_like(x)
    return {"torch_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, out),
            "torch_two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)}


def config_text(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items())) or "-"


def run(options: Any) -> dict[str, Any]:
    """The collectives benchmark on `options.world` ranks (see the module docstring)."""
    from autofuse.comm.world import default_device_kind, gpu_count, spawn

    kind = getattr(options, "device_kind", "") or default_device_kind()
    world = getattr(options, "world", None) or (gpu_count() if kind == "cuda" else 2)
    modes = list(getattr(options, "modes", None) or (["graph", "eager"] if kind == "cuda" else ["eager"]))
    if kind != "cuda" and "graph" in modes:
        raise ValueError("graph mode needs CUDA graphs; on CPU only eager mode exists")
    sizes = parse_sizes(getattr(options, "shapes", None)) or list(GPU_SIZES if kind == "cuda" else CPU_SIZES)
    variants = getattr(options, "variants", None)
    kinds = [k for k in KINDS if not variants or any(_wanted(k, i, variants) for i in IMPLS[k])]
    if variants and not kinds:
        raise ValueError(f"--variants {variants} names no collective or implementation; use {KINDS} or "
                         f"{sorted({i for v in IMPLS.values() for i in v})}")
    reps = int(getattr(options, "reps", 20) or 20) if kind == "cuda" else min(3, int(getattr(options, "reps", 3) or 3))
    results = spawn(bench_rank, world, kinds, sizes, modes, reps, variants, getattr(options, "progress", True),
                    device_kind=kind, timeout_s=3600)
    result = dict(results[0], device_kind=kind, notes=[TARGETS] if kind == "cuda" else [CPU_NOTE])
    result["best"] = best_rows(result["rows"])
    return result


def best_rows(rows: Sequence[dict]) -> list[dict]:
    """Per (kind, bytes, mode): the library's time, the best heap implementation, its speedup and bandwidth."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["bytes"], r["mode"]), []).append(r)
    out = []
    for (kind, nbytes, mode), rs in groups.items():
        lib = next((r for r in rs if r["impl"] in ("nccl", "gloo")), None)
        alts = {r["impl"]: r["us"] for r in rs if r["impl"] in ALTERNATIVES.get(kind, ()) and r["us"] == r["us"]}
        heap = [r for r in rs if r["impl"] not in ("nccl", "gloo", *alts) and not r["error"] and r["us"] == r["us"]]
        per_impl: dict[str, dict] = {}
        for r in heap:
            if r["impl"] not in per_impl or r["us"] < per_impl[r["impl"]]["us"]:
                per_impl[r["impl"]] = r
        best = min(heap, key=lambda r: r["us"]) if heap else None
        lib_us = lib["us"] if lib else math.nan
        out.append({"kind": kind, "bytes": nbytes, "mode": mode, "library_us": lib_us,
                    "impl_us": {k: v["us"] for k, v in per_impl.items()},
                    "impl_config": {k: v["config"] for k, v in per_impl.items()},
                    "failed": sorted({r["impl"] for r in rs if r["error"]} - set(per_impl)),
                    "best": best["impl"] if best else None, "best_us": best["us"] if best else math.nan,
                    "best_config": best["config"] if best else None,
                    "speedup": lib_us / best["us"] if best and best["us"] > 0 else math.nan,
                    "alternative_us": alts,
                    "own_vs_alternative": (min(alts.values()) / best["us"] if alts and best and best["us"] > 0
                                           else math.nan),
                    "busbw_GBps": best.get("busbw_GBps", math.nan) if best else math.nan,
                    "library_busbw_GBps": lib.get("busbw_GBps", math.nan) if lib else math.nan})
    return out


def size_text(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KB" if n >= 1 << 10 else f"{n} B"


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.{digits}f}"


def render(result: dict[str, Any], console: Any) -> None:
    """One table per collective and mode (sizes as rows, implementations as columns), then the notes."""
    from autofuse.bench.tables import print_split_table

    best = result.get("best") or best_rows(result["rows"])
    lib_name = "NCCL" if result.get("device_kind") == "cuda" else "gloo"
    gpu = result.get("device_kind") == "cuda"  # the CPU emulation's times are never shown as a speedup
    for kind in result["kinds"]:
        impls = list(IMPLS[kind])
        for mode in result["modes"]:
            rows = sorted((b for b in best if b["kind"] == kind and b["mode"] == mode), key=lambda b: b["bytes"])
            if not rows:
                continue
            alts = [a for a in ALTERNATIVES.get(kind, ()) if any(a in b.get("alternative_us", {}) for b in rows)]
            body = []
            for b in rows:
                cells = [_f(b["impl_us"].get(i)) if i in b["impl_us"] else ("fail" if i in b["failed"] else "-")
                         for i in impls]
                alt_cells = [_f(b.get("alternative_us", {}).get(a)) for a in alts]
                body.append([size_text(b["bytes"]), _f(b["library_us"]), *alt_cells, *cells, b["best"] or "-",
                             *([_f(b["speedup"], 2), _f(b["busbw_GBps"], 0)] if gpu else []),
                             *([_f(b.get("own_vs_alternative"), 2)] if gpu and alts else [])])
            print_split_table(console, f"{kind}, {mode} mode, {result.get('dtype', '')}, {result['world']} ranks: us "
                              "per call (median, rank-max; best config per column)", ["size"],
                              [lib_name, *alts, *impls, "best", *([f"x {lib_name}", "bus GB/s"] if gpu else []),
                               *(["own/alt"] if gpu and alts else [])], body)
    failures = [r for r in result["rows"] if r.get("error")]
    for r in failures[:10]:
        console.print(f"  {r['kind']} {size_text(r['bytes'])} {r['impl']} {config_text(r['config'])}: {r['error']}",
                      style="yellow")
    if len(failures) > 10:
        console.print(f"  ... and {len(failures) - 10} more failed configs (see the JSON)", style="yellow")
    for line in result.get("notes", []):
        console.print(line, style="yellow")
