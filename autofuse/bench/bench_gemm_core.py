"""`autofuse bench gemm_core`: the GEMM core alone (kernels/gemm_core.py) against cuBLAS, one GPU.

For every shape (C = A @ B, A M x K, B K x N, bf16, row-major), in one run: each candidate config
of the core (autofuse.core.gemm.defaults for the shape with their stream-K twins where the last wave
idles SMs, the pointer-path twin of the first default, and a few regime extras: warp
specialisation, other tiles) is first checked against torch.matmul on random inputs (NaN-poisoned
output, relative error within default_tolerance); the correct ones are timed, and so is
torch.matmul (cuBLAS). Per mode the row reports the best core config, its time, the best time
without stream-K (`dp_us`: what the core did before it), cuBLAS's time, their ratio and whether
it meets issue 29's target: no shape above 1.10x of cuBLAS; the summary's geomeans have their own
targets (<= 1.05 at M <= 256, <= 1.03 at M >= 512).

--dtype fp8: the same sweep in FP8 (float8_e4m3fn A, B stored N x K as weights are, bfloat16
output) against torch._scaled_mm (cuBLASLt) with fast accumulation (use_fast_accum=True: the FP8
accumulation Triton's Hopper dot uses too), tensorwise scales for every config; the best config
and _scaled_mm are then also timed with row-wise scales (`rowwise_core_us`, `rowwise_vendor_us`).
Targets: no shape above 1.15x, geomean <= 1.05.

Modes: `graph` (the calls captured in a CUDA graph and replayed: launch cost removed) and `eager`
(back-to-back launches between two events). Each measurement is the median of `reps` batches of
`inner` calls, inner sized to ~0.5 ms of work; big shapes take fewer batches (at least 5) so a
measurement stays under ~0.3 s.

Sweeps: `gpu` (the default with a GPU): M in GPU_M x N in {3584, 5120, 8192, 28672} x K in {8192,
14336}, 64 shapes, about a minute on one H100 (45-60 s a dtype, 2026-11-26): each distinct config
(~70; ~500 with --search wide) is first compiled once in COMPILE_WORKERS processes (`precompile`),
then the timing pass loads it from Triton's cache; `full`: every power of two M from 16 to 16384
(88 shapes); `cpu`
(the default without a GPU): three tiny shapes under Triton's interpreter, in a child process, in
seconds: interpreter timings that only show the core runs and agrees with torch, nothing about speed.

--shapes: comma-separated items, each `M`, `MxN` or `MxNxK`; a shape of the sweep is kept if it
matches any item (e.g. `--shapes 16,64x3584,1024x28672x8192`).
--variants: the config families to time, from FAMILIES (default all): a config is timed when every
family it belongs to is listed, e.g. `--variants tma,ptr,swap,splitk,ws` leaves out stream-K
(the core as it was before stream-K). cuBLAS is always timed.
--search: `defaults` (the candidates above: what the ops try first) or `wide`: those plus the `wide`
grid (tile x warps x stages x load path, swap-AB for skinny M, the auto split, warp-specialised,
stream-K and partial-wave split-K twins; 40-280 configs a shape): what the core can reach on a shape
when tuned, the evidence behind gemm.defaults (docs/results/gemm_core.md). About a minute a dtype
for 8-30 shapes on one H100; pass --shapes.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from autofuse.core import gemm
from autofuse.core.gemm import GemmConfig
from autofuse.measure.timing import capture, events_us
from autofuse.core.op import default_tolerance

if TYPE_CHECKING:
    from autofuse.comm.world import World

N_SET = (3584, 5120, 8192, 28672)
K_SET = (8192, 14336)
GPU_M = (16, 64, 128, 256, 512, 1024, 4096, 16384)
FULL_M = tuple(16 << i for i in range(11))
CPU_SHAPES = ((16, 64, 64), (40, 72, 48), (64, 128, 96))
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
BATCH_US = 500.0           # work per timed batch
MEASURE_S = 0.3            # at most this long per measurement (reps cut, never below MIN_REPS)
MIN_REPS = 5
CPU_REPS = 2
DEFAULT_SWEEP = {"cuda": "gpu", "cpu": "cpu"}  # the shapes, when --sweep is not given
WORLD = 1  # one device: the core against the vendor GEMM
FAMILIES = ("tma", "ptr", "swap", "splitk", "ws", "streamk")
SEARCHES = ("defaults", "wide")
COMPILE_WORKERS = 12      # on a GPU: processes that compile a sweep's configs before the timing pass
# --search wide: (BLOCK_M, BLOCK_N, BLOCK_K in 16-bit, num_warps) from 16 rows up (FP8 doubles BLOCK_K, at
# most 256), and (BLOCK_N, BLOCK_K, num_warps) of the skinny tiles (BLOCK_M = the rows' power of two, <= 64)
WIDE_TILES = ((64, 64, 128, 4), (64, 128, 64, 4), (64, 128, 128, 4), (64, 256, 64, 4), (64, 256, 64, 8),
              (128, 64, 64, 4), (128, 128, 64, 4), (128, 128, 64, 8), (128, 128, 128, 8), (128, 256, 64, 8),
              (128, 256, 64, 4), (256, 128, 64, 8))
WIDE_SKINNY = ((64, 256, 4), (128, 128, 4), (128, 256, 4), (256, 128, 4))
WIDE_STAGES = (3, 4, 5, 6)
WAVE_SPLITS = (2, 3, 4)   # --search wide: split-K twins of tiles that end in a partial wave
SHAPE_TARGETS = {"bf16": 1.10, "fp8": 1.15}  # issue 29: no shape's core/vendor time above this
GEOMEAN_TARGETS = {"bf16": {"M<=256": 1.05, "M>=512": 1.03}, "fp8": {"M<=256": 1.05, "M>=512": 1.05}}
VENDOR = {"bf16": "torch.matmul (cuBLAS)", "fp8": "torch._scaled_mm (cuBLASLt, fast accumulation)"}
CPU_NOTE = ("CPU: Triton-interpreter and torch CPU timings, not GPU timings: they show that the core runs "
            "and agrees with torch.matmul, not how fast it is. Run the same command on a GPU machine.")


# ---------------------------------------------------------------------------------------------
# shapes and candidates
def sweep_shapes(sweep: str) -> list[tuple[int, int, int]]:
    """(M, N, K) of a sweep, ordered so consecutive shapes share B (K, then N, then M)."""
    if sweep == "cpu":
        return list(CPU_SHAPES)
    if sweep not in ("gpu", "full"):
        raise ValueError(f"gemm_core sweeps are gpu, full and cpu, not {sweep!r}")
    ms = GPU_M if sweep == "gpu" else FULL_M
    return [(m, n, k) for k in K_SET for n in N_SET for m in ms]


def parse_shapes(items: Sequence[str] | None) -> list[tuple[int, ...]] | None:
    """--shapes items ('M', 'MxN', 'MxNxK', comma-separated, repeatable) -> prefixes to match."""
    if not items:
        return None
    out: list[tuple[int, ...]] = []
    for item in items:
        for spec in str(item).split(","):
            spec = spec.strip().lower()
            if not spec:
                continue
            parts = spec.split("x")
            if len(parts) > 3 or not all(p.isdigit() for p in parts):
                raise ValueError(f"--shapes takes M, MxN or MxNxK items such as 64,1024x3584, not {spec!r}")
            out.append(tuple(int(p) for p in parts))
    return out or None


def select(shapes: list[tuple[int, int, int]], keep: list[tuple[int, ...]] | None) -> list[tuple[int, int, int]]:
    if not keep:
        return shapes
    return [s for s in shapes if any(s[:len(prefix)] == prefix for prefix in keep)]


def candidates(m: int, n: int, k: int, dtype: str = "bfloat16", search: str = "defaults") -> list[dict]:
    """The configs timed for one shape: gemm.defaults (what the ops enqueue first) with their
    stream-K twins, the pointer twin of the first default (TMA's gain), and per regime a
    warp-specialised and a wider tile (with its stream-K twin where the last wave leaves SMs idle);
    with search="wide" the `wide` grid follows."""
    if search not in SEARCHES:
        raise ValueError(f"gemm_core --search is {' or '.join(SEARCHES)}, not {search!r}")
    configs = gemm.defaults(m, n, k, dtype, stream_k=True)
    first = GemmConfig.from_dict(configs[0])
    extra = [first.replace(TMA=False, WARP_SPEC=False)]
    bk = 2 if dtype == gemm.FP8 else 1  # FP8 tiles take twice the K for the same bytes
    if not gemm.tiny(m, n, k):
        small = min(64, max(16, gemm.next_pow2(m)))
        if m <= 64:
            extra.append(GemmConfig(small, 128, min(128 * bk, 256), 8, 4, 4, SWAP_AB=True, WARP_SPEC=True))
        elif m <= 512:
            extra.append(GemmConfig(128, 256, 64 * bk, 8, 8, 3))
        else:
            extra.append(GemmConfig(128, 128, 128 * bk, 8, 8, 3))
    for c in extra:
        for d in (c.to_dict(), c.replace(SPLIT_K=1, WARP_SPEC=False, STREAM_K=True).to_dict()):
            if d["STREAM_K"] and not gemm.stream_k_helps(c.tiles(m, n), gemm.cdiv(k, c.BLOCK_K)):
                continue
            if gemm.check(d, m, n, k, dtype, stream_k=True) is None and d not in configs:
                configs.append(d)
    if search == "wide":
        configs += [d for d in wide(m, n, k, dtype) if d not in configs]
    return configs


def wide(m: int, n: int, k: int, dtype: str = "bfloat16") -> list[dict]:
    """The --search wide grid of a shape: each WIDE_TILES tile (WIDE_SKINNY with and without swap-AB
    at <= 64 rows) at each of WIDE_STAGES, with TMA loads (where the strides allow) and pointer
    loads, split-K as gemm.auto_split picks it; then each one's warp-specialised twin, its stream-K
    twin where the last wave leaves SMs idle, and where its tiles end in a partial wave its split-K
    twins at WAVE_SPLITS (K steps divide evenly at any split: 80 tiles of 128x256 on 132 SMs make
    240 items at a split of 3, 91% of two waves against 61% of one; measured, they lose: gemm_core.md).
    A tile count under one wave (skinny, memory-bound shapes: 112 tiles of 64x128 at 256 x 3584 keep
    20 of 132 SMs idle) gets its stream-K and split-K twins however full that wave is.
    Every config passes gemm.check (shared memory, registers, blocks the problem needs); none on
    tiny (interpreter) shapes."""
    if gemm.tiny(m, n, k):
        return []
    fp8 = dtype == gemm.FP8
    tma = gemm.check(GemmConfig(16, 16, 32), m, n, k, dtype) is None  # only TMA's stride rule can refuse it
    small = min(64, max(16, gemm.next_pow2(m)))
    bases: list[GemmConfig] = []
    if m <= 64:
        bases += [GemmConfig(small, bn, bk, 8, w, SWAP_AB=swap) for bn, bk, w in WIDE_SKINNY for swap in (True, False)]
    bases += [GemmConfig(bm, bn, bk, 8, w) for bm, bn, bk, w in WIDE_TILES if bm <= max(64, gemm.next_pow2(m))]
    out: list[dict] = []
    paths = (True, False) if tma else (False,)  # TMA loads, and cp.async pointer loads (no C tile in shared memory)
    for base in bases:
        bk = min(2 * base.BLOCK_K, 256) if fp8 else base.BLOCK_K
        for stages, path in ((s, p) for p in paths for s in WIDE_STAGES):
            c = base.replace(BLOCK_K=min(bk, max(16, gemm.next_pow2(k))), num_stages=stages, TMA=path)
            c = c.replace(SPLIT_K=gemm.auto_split(c.tiles(m, n), gemm.cdiv(k, c.BLOCK_K)))
            twins = [c, c.replace(SPLIT_K=1, WARP_SPEC=True), c.replace(SPLIT_K=1, STREAM_K=True)]
            one_wave = c.tiles(m, n) < gemm.H200_SMS  # fewer tiles than SMs: memory-bound shapes want every SM
            if c.SPLIT_K == 1 and (gemm.last_wave_fill(c.tiles(m, n)) <= 0.8 or one_wave):  # a partial last wave
                twins += [c.replace(SPLIT_K=split) for split in WAVE_SPLITS
                          if gemm.cdiv(k, c.BLOCK_K) // split >= 4]
            for t in twins:
                d = t.to_dict()
                if t.STREAM_K and not (one_wave or gemm.stream_k_helps(t.tiles(m, n), gemm.cdiv(k, t.BLOCK_K))):
                    continue
                if t.WARP_SPEC and t.num_warps != 4:
                    continue
                if d not in out and gemm.check(d, m, n, k, dtype, stream_k=True) is None:
                    out.append(d)
    return out


def families(config: dict) -> set[str]:
    """The FAMILIES a config belongs to: its load path (tma or ptr) and each switch it turns on."""
    c = GemmConfig.from_dict(config)
    out = {"tma" if c.TMA else "ptr"}
    out |= {name for name, on in (("swap", c.SWAP_AB), ("splitk", c.SPLIT_K > 1), ("ws", c.WARP_SPEC),
                                  ("streamk", c.STREAM_K)) if on}
    return out


def parse_variants(items: Sequence[str] | None) -> set[str] | None:
    if not items:
        return None
    chosen = {v.strip() for item in items for v in str(item).split(",") if v.strip()}
    unknown = sorted(chosen - set(FAMILIES))
    if unknown:
        raise ValueError(f"gemm_core --variants are config families {', '.join(FAMILIES)}, not {', '.join(unknown)}")
    return chosen


def config_text(config: dict) -> str:
    """'128x256x64 w8 s3' + ' sk4' (split-K) + ' swap' + ' ws' + ' streamk' + ' ptr' (no TMA)."""
    c = GemmConfig.from_dict(config)
    text = f"{c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K} w{c.num_warps} s{c.num_stages}"
    if c.SPLIT_K > 1:
        text += f" sk{c.SPLIT_K}"
    if c.GROUP_M != 8:
        text += f" g{c.GROUP_M}"
    return (text + (" swap" if c.SWAP_AB else "") + (" ws" if c.WARP_SPEC else "") + (" streamk" if c.STREAM_K else "")
            + ("" if c.TMA else " ptr"))


# ---------------------------------------------------------------------------------------------
# timing
def _plan(fn: Callable[[], Any], reps: int) -> tuple[int, int]:
    """(inner, reps) for a call of `fn`: batches of ~BATCH_US, at most MEASURE_S per measurement."""
    one = events_us(fn, 2)
    inner = max(1, min(200, round(BATCH_US / max(one, 1e-3))))
    batch_s = inner * one * 1e-6
    return inner, max(MIN_REPS, min(reps, int(MEASURE_S / max(batch_s, 1e-9))))


def time_cuda(fn: Callable[[], Any], mode: str, reps: int) -> float:
    """Median us per call of `fn` on the current CUDA device, in `mode` (graph or eager)."""
    inner, reps = _plan(fn, reps)
    if mode == "eager":
        return statistics.median(events_us(fn, inner) for _ in range(reps))
    graph = capture(None, lambda: [fn() for _ in range(inner)])
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(events_us(graph.replay, 1) / inner for _ in range(reps))


def time_cpu(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 on the tensors' device; inf where out holds NaN/inf."""
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# the run
def _opt(options: Any, name: str, default: Any) -> Any:
    value = getattr(options, name, None) if not isinstance(options, dict) else options.get(name)
    return default if value is None else value


def weights(n: int, k: int, dtype: str, device: torch.device) -> torch.Tensor:
    """B (K x N) of a shape: row-major bf16, or FP8 stored N x K (a weight, as torch._scaled_mm takes B)."""
    if dtype == "fp8":
        return torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    return torch.randn(k, n, device=device, dtype=torch.float32).to(torch.bfloat16)


def fp8_scales(m: int, n: int, scaling: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positive float32 scales (tensorwise: one each; rowwise: M x 1 and 1 x N)."""
    g = torch.Generator(device="cpu").manual_seed(m * 31 + n)
    shapes = ((1,), (1,)) if scaling == "tensorwise" else ((m, 1), (1, n))
    return tuple((torch.rand(s, generator=g) + 0.5).to(device) for s in shapes)  # type: ignore[return-value]


def _vendor(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scales: tuple | None) -> Callable[[], Any]:
    """The vendor call of the run: torch.matmul into c (bf16), or torch._scaled_mm (FP8)."""
    if scales is None:
        return lambda: torch.matmul(a, b, out=c)
    sa, sb = scales
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def _measure_shape(m: int, n: int, k: int, b: torch.Tensor, modes: Sequence[str], reps: int, device: torch.device,
                   say: Callable[[str], None], allowed: set[str] | None = None, dtype: str = "bf16",
                   search: str = "defaults") -> list[dict]:
    """Rows (one per mode) of one shape: every candidate checked, then timed; the vendor GEMM timed
    (FP8: the best config and the vendor again with row-wise scales)."""
    fp8 = dtype == "fp8"
    a = torch.randn(m, k, device=device, dtype=torch.float32).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    scales = fp8_scales(m, n, "tensorwise", device) if fp8 else None
    scale_kw = {"scale_a": scales[0], "scale_b": scales[1]} if scales else {}
    ref = _vendor(a, b, c, scales)().clone()
    tol = default_tolerance(DTYPES[dtype], k)
    cuda = device.type == "cuda"
    timer = (lambda fn, mode: time_cuda(fn, mode, reps)) if cuda else (lambda fn, mode: time_cpu(fn, reps))
    cublas = {mode: timer(_vendor(a, b, c, scales), mode) for mode in modes}
    say(f"M={m} N={n} K={k} {VENDOR[dtype]}: " + ", ".join(f"{md} {t:.1f} us" for md, t in cublas.items()))
    results: list[dict] = []
    for config in candidates(m, n, k, DTYPES[dtype], search):
        if allowed is not None and not families(config) <= allowed:
            continue
        entry: dict[str, Any] = {"config": config, "text": config_text(config), "us": {}, "error": None}
        try:
            launch = gemm.prepare(a, b, config, c, **scale_kw)
            c.fill_(math.nan)
            launch()
            if cuda:
                torch.cuda.synchronize()
            err = _rel_err(c, ref)
            entry["rel_error"] = err if math.isfinite(err) else None
            if not err <= 2 * tol:  # the vendor rounds too: twice the float64 reference's allowance
                entry["error"] = f"wrong result: rel error {err:.3g} vs {VENDOR[dtype]} > {2 * tol:.3g}"
            else:
                entry["us"] = {mode: timer(launch, mode) for mode in modes}
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            entry["error"] = f"{type(exc).__name__}: {first_line}"
        say(f"M={m} N={n} K={k} {entry['text']}: " + (entry["error"] or ", ".join(
            f"{md} {t:.1f} us" for md, t in entry["us"].items())))
        results.append(entry)
    rows = []
    for mode in modes:
        timed = [e for e in results if mode in e["us"]]
        best = min(timed, key=lambda e: e["us"][mode]) if timed else None
        core = best["us"][mode] if best else None
        ratio = core / cublas[mode] if core else None
        target = SHAPE_TARGETS[dtype] if cuda else None  # interpreter timings have no target
        dp = [e["us"][mode] for e in timed if not e["config"].get("STREAM_K")]
        rowwise: dict[str, Any] = {}
        if fp8 and best is not None:
            row_scales = fp8_scales(m, n, "rowwise", device)
            launch = gemm.prepare(a, b, best["config"], c, scale_a=row_scales[0], scale_b=row_scales[1])
            rowwise = {"rowwise_core_us": timer(launch, mode),
                       "rowwise_vendor_us": timer(_vendor(a, b, c, row_scales), mode)}
        rows.append({
            "M": m, "N": n, "K": k, "dtype": DTYPES[dtype], "mode": mode, **rowwise,
            "cublas_us": cublas[mode], "core_us": core,
            "dp_us": min(dp) if dp else None, "core_vs_cublas": ratio, "target": target,
            "meets_target": None if ratio is None or target is None else ratio <= target,
            "best_config": best["config"] if best else None, "best_text": best["text"] if best else None,
            "configs": [{"config": e["text"], "us": e["us"].get(mode), "error": e["error"]} for e in results],
        })
    return rows


def _run_rows(opts: dict) -> dict:
    """The benchmark on this process's device (CUDA, or CPU under the interpreter)."""
    cuda = torch.cuda.is_available() and opts["device_kind"] != "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    modes = [md for md in opts["modes"] if cuda or md == "eager"] or ["eager"]
    reps = opts["reps"] if cuda else min(opts["reps"], CPU_REPS)
    say = (lambda text: print(text, flush=True)) if opts["progress"] else (lambda text: None)
    dtype = opts["dtype"]
    torch.manual_seed(0)
    shapes = select(sweep_shapes(opts["sweep"]), opts["keep"])
    if opts["limit"]:
        shapes = shapes[:opts["limit"]]
    started = time.perf_counter()
    if cuda:  # every distinct config compiled in parallel first: the timing pass loads them from the cache
        precompile(shapes, dtype, opts["search"], device, COMPILE_WORKERS, say)
    rows: list[dict] = []
    b_key, b = None, None
    for i, (m, n, k) in enumerate(shapes):
        if b_key != (n, k):
            b = None
            b = weights(n, k, dtype, device)
            b_key = (n, k)
        say(f"[{i + 1}/{len(shapes)}] M={m} N={n} K={k}")
        rows.extend(_measure_shape(m, n, k, b, modes, reps, device, say, opts["variants"], dtype, opts["search"]))
    notes = [] if cuda else [CPU_NOTE]
    return {"rows": rows, "summary": summary(rows) if cuda else {}, "sweep": opts["sweep"], "world": 1,
            "dtype": dtype, "vendor": VENDOR[dtype],
            "device_kind": "cuda" if cuda else "cpu",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
            "modes": modes, "search": opts["search"], "seconds": round(time.perf_counter() - started, 1),
            "notes": notes}


def _compile_some(job: tuple[str, str, list[tuple[dict, tuple[int, int, int]]]]) -> list[str]:
    """One precompile worker: launch each (config, shape) once, on the timing pass's B layout (Triton
    compiles the kernel into its on-disk cache); returns the failures as lines (the timing pass
    reports them again)."""
    dtype, where, items = job
    device = torch.device(where)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fp8 = dtype == "fp8"
    failed = []
    for config, (m, n, k) in items:
        try:
            a = torch.zeros(m, k, device=device, dtype=torch.bfloat16)
            a = a.to(torch.float8_e4m3fn) if fp8 else a
            c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            scales = dict(zip(("scale_a", "scale_b"), fp8_scales(m, n, "tensorwise", device))) if fp8 else {}
            gemm.prepare(a, weights(n, k, dtype, device), config, c, **scales)()
        except Exception as exc:  # noqa: BLE001 - reported, and the timing pass tries it again
            failed.append(f"{config_text(config)} at {m}x{n}x{k}: {type(exc).__name__}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return failed


def precompile(shapes: Sequence[tuple[int, int, int]], dtype: str, search: str, device: torch.device, workers: int,
               say: Callable[[str], None]) -> list[str]:
    """Compile every distinct config of `shapes` in `workers` processes on `device` before timing
    (a sweep holds 50-250 distinct kernels, ~2-3 s of compile each: minutes in one process).
    Each config runs once at the smallest shape that holds it; the timing pass then loads the
    kernels from Triton's on-disk cache. Kernels do run concurrently here: nothing is timed."""
    import concurrent.futures
    import multiprocessing

    first: dict[str, tuple[dict, tuple[int, int, int]]] = {}
    for m, n, k in sorted(shapes, key=lambda s: s[0] * s[1] * s[2]):
        for config in candidates(m, n, k, DTYPES[dtype], search):
            first.setdefault(config_text(config), (config, (m, n, k)))
    items = list(first.values())
    jobs = [(dtype, str(device), items[i::workers]) for i in range(workers) if items[i::workers]]
    say(f"compiling {len(items)} distinct configs in {len(jobs)} processes")
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [line for lines in pool.map(_compile_some, jobs) for line in lines]
    say(f"compiled in {time.perf_counter() - started:.0f} s" + (f"; {len(failed)} failed: " + "; ".join(failed[:5])
                                                                 if failed else ""))
    return failed


def _child(world: World, opts: dict) -> dict:
    return _run_rows(opts)


def run(options: Any) -> dict:
    """Run the benchmark (see the module docstring); options: sweep, shapes, variants, reps, modes,
    limit, progress, device_kind, dtype (bf16 or fp8; attributes of autofuse bench's options, or a
    dict). Returns JSON-able data with "rows"; writes no file. On CPU it runs in one interpreter child
    process."""
    kind = _opt(options, "device_kind", "") or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _opt(options, "dtype", "bf16")
    if dtype not in DTYPES:
        raise ValueError(f"gemm_core --dtype is bf16 or fp8, not {dtype!r}")
    opts = {
        "dtype": dtype,
        "device_kind": kind,
        "sweep": _opt(options, "sweep", DEFAULT_SWEEP[kind]),
        "keep": parse_shapes(_opt(options, "shapes", None)),
        "variants": parse_variants(_opt(options, "variants", None)),
        "reps": int(_opt(options, "reps", 20)),
        "modes": list(_opt(options, "modes", ["graph", "eager"])),
        "limit": _opt(options, "limit", None),
        "progress": bool(_opt(options, "progress", True)),
        "search": _opt(options, "search", "defaults"),
    }
    if opts["search"] not in SEARCHES:
        raise ValueError(f"gemm_core --search is {' or '.join(SEARCHES)}, not {opts['search']!r}")
    sweep_shapes(opts["sweep"])  # unknown sweep names fail here, before any work
    if kind == "cuda":
        return _run_rows(opts)
    from autofuse.comm.world import spawn

    return spawn(_child, 1, opts, device_kind="cpu", timeout_s=600)[0]


# ---------------------------------------------------------------------------------------------
# rendering
def _f(x: Any, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _geomean(xs: Sequence[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Per mode: geomean core/cuBLAS time ratio at M <= 256 and at M >= 512, the same without
    stream-K ('... dp'), the shapes within their SHAPE_TARGETS, and FP8's row-wise geomean."""
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode and r["core_vs_cublas"]]
        entry = {}
        for name, keep in (("M<=256", lambda r: r["M"] <= 256), ("M>=512", lambda r: r["M"] >= 512)):
            entry[name] = _geomean([r["core_vs_cublas"] for r in mine if keep(r)])
            entry[name + " dp"] = _geomean([r["dp_us"] / r["cublas_us"] for r in mine if keep(r) and r.get("dp_us")])
        entry["rowwise"] = _geomean([r["rowwise_core_us"] / r["rowwise_vendor_us"] for r in mine
                                     if r.get("rowwise_core_us") and r.get("rowwise_vendor_us")])
        entry["met"] = sum(bool(r["meets_target"]) for r in mine)
        entry["of"] = len([r for r in rows if r["mode"] == mode])
        out[mode] = entry
    return out


def render(result: dict, console: Any) -> None:
    """One table per mode (M, N, K, vendor us, core us, the best without stream-K, core/vendor, target
    met, best config), then a summary line per mode and the notes; tables split at 80 columns."""
    from autofuse.bench.tables import print_split_table

    rows = result.get("rows", [])
    gpu = result.get("device_kind") == "cuda"  # the CPU emulation's times are never compared as speed
    dtype = result.get("dtype", "bf16")
    for mode in [md for md in ("graph", "eager") if any(r["mode"] == md for r in rows)]:
        body = []
        for r in (r for r in rows if r["mode"] == mode):
            ok = "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "NO")
            body.append([str(r["M"]), str(r["N"]), str(r["K"]), _f(r["cublas_us"]), _f(r["core_us"]),
                         _f(r.get("dp_us")), *([_f(r["core_vs_cublas"], 2), ok] if gpu else []),
                         r["best_text"] or "all failed"])
        print_split_table(console, f"gemm_core vs {VENDOR[dtype]}, {result.get('device', '')}, {mode} mode, "
                          f"{DTYPES[dtype]}, us per call; no sk = best without stream-K"
                          + (f"; x = core / vendor time, ok = within {SHAPE_TARGETS[dtype]}x" if gpu else ""),
                          ["M", "N", "K"], ["vendor", "core", "no sk", *(["x", "ok"] if gpu else []),
                                            "best core config"], body)
    for mode, s in summary(rows).items():
        if result.get("device_kind") != "cuda":
            continue
        goal = GEOMEAN_TARGETS[dtype]
        console.print(f"{mode}: core/vendor time, geomean: M<=256 {_f(s['M<=256'], 3)} (target {goal['M<=256']}; "
                      f"without stream-K {_f(s['M<=256 dp'], 3)}), M>=512 {_f(s['M>=512'], 3)} (target "
                      f"{goal['M>=512']}; without stream-K {_f(s['M>=512 dp'], 3)}); {s['met']} of {s['of']} "
                      f"shapes within {SHAPE_TARGETS[dtype]}x"
                      + (f"; row-wise scales: core/vendor geomean {_f(s['rowwise'], 3)}" if s.get("rowwise") else ""))
    failed = [(r["M"], r["N"], r["K"], c["config"], c["error"]) for r in rows if r["mode"] == rows[0]["mode"]
              for c in r["configs"] if c["error"]] if rows else []
    for m, n, k, text, why in failed[:12]:
        console.print(f"  failed: M={m} N={n} K={k} {text}: {why}")
    if len(failed) > 12:
        console.print(f"  ... and {len(failed) - 12} more failed configs (see the JSON)")
    for note in result.get("notes", []):
        console.print(note)
