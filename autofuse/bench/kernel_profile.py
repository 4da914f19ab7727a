"""Per-kernel time breakdown of one variant (`autofuse bench OP --profile`): where a call's time goes.

The bench's latency says how fast a variant is; this says why: which kernels run per call, how
long each takes on the device, and how much of the measured latency the device spends idle (launch
tax, waits between kernels). After a variant's normal measurement, its best config is built again
and the same callables the bench times (rotated input sets, `runner(*inputs, out=out)`; in graph
mode one captured CUDA graph of them, replayed) run `PROFILE_CALLS` times under
`torch.profiler.profile`. Every rank runs the same calls in lockstep (collectives inside the calls
would hang otherwise) and profiles alike, so no rank is slowed more than its peers; only rank 0's
trace is reduced. On GPUs the calls queue behind a short sleep kernel, so that the profiler's host
overhead does not turn them host-bound: they run back to back, as when the bench times them, and
"busy" against the bench's measured latency shows what the device idles per call.

On GPUs the table lists device activity (kernels, memcpy, memset) by shortened kernel name; on the
CPU emulation it lists torch CPU ops by self time (the Triton interpreter's Python time is in no op).
"""
from __future__ import annotations

import math
import re
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

if TYPE_CHECKING:
    from autofuse.comm.world import World

PROFILE_CALLS = 20   # op calls profiled per (problem, variant, mode), after warm-up
PROFILE_WARMUP = 3   # untraced calls first (steady state; caches and autotuning settled)
PROFILE_KEEP = 24    # kernels kept per profile in the JSON; the rest are summed into one "(other)" entry
MARK = "autofuse.profile"  # the record_function range around the profiled calls
QUEUE_AHEAD_FACTOR = 4.0   # GPU sleep before the profiled calls, in multiples of the host's time to issue them
_SLEEP_HZ = 2.0e9          # cycles per second torch.cuda._sleep is sized with (Hopper boost; slower clocks sleep longer)
# Host API calls that start device work: their count per op call is the launches a call pays.
_LAUNCH_NAMES = ("LaunchKernel", "GraphLaunch", "LaunchCooperativeKernel")
_KERNELISH = re.compile(r"(\w+(?:Functor|functor|_kernel_cuda|_kernel|_impl))\b")
_QUALIFIED = re.compile(r"([A-Za-z_][\w:]*)")


def short_name(name: str) -> str:
    """A device kernel's name without its return type, namespaces, template arguments and parameters.

    C++ kernels carry their whole signature (`void at::native::vectorized_elementwise_kernel<4,
    at::native::FillFunctor<float>, ...>(int, ...)`); what tells kernels apart is the base name and,
    for generic templates, the functor they run: `vectorized_elementwise_kernel[FillFunctor]`.
    Triton kernels (their function name), NCCL (`ncclDevKernel_AllReduce_Sum_bf16_RING_LL`) and
    cuBLAS (`nvjet_...`, `sm90_xmma_...`) names are already short and keep everything but parameters.
    """
    text = name.strip().replace("(anonymous namespace)::", "")
    if text.startswith("void "):
        text = text[5:]
    cut = min((i for i in (text.find("<"), text.find("(")) if i >= 0), default=len(text))
    base = text[:cut].strip().rsplit("::", 1)[-1] or text[:cut].strip()
    if cut < len(text) and text[cut] == "<":
        args = text[cut + 1:]
        inner = [m for m in _KERNELISH.findall(args) if m != base]
        if not inner:
            inner = [q.rsplit("::", 1)[-1] for q in _QUALIFIED.findall(args.split(",", 1)[0])]
        if inner:
            return f"{base}[{inner[0]}]"
    return base


def _union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals: time at least one of them was running."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _in_window(events: Sequence[Any], queued: bool) -> tuple[list[Any], list[Any], float]:
    """(device events, host events, wall us) of the profiled calls: what ran inside the MARK range.

    Device work from before the range finished before it began (the range starts after a device
    sync), so every device event that starts inside or after it belongs to the range. With `queued`,
    the first of them is the queue-ahead sleep (`_queue_ahead`, launched first onto an idle GPU):
    it is left out, and the wall time runs from its end to the last device event's end. Otherwise
    the wall time is the range's (on CPU: the host's time for the calls).
    """
    marks = [e for e in events if e.name == MARK and e.device_type == torch.autograd.DeviceType.CPU]
    if not marks:
        return [], [], math.nan
    start, end = marks[0].time_range.start, marks[0].time_range.end
    device, host = [], []
    for e in events:
        if e.name == MARK or getattr(e, "is_user_annotation", False):
            continue
        if e.device_type != torch.autograd.DeviceType.CPU:
            if e.time_range.start >= start:
                device.append(e)
        elif e.time_range.start >= start and e.time_range.end <= end:
            host.append(e)
    device.sort(key=lambda e: e.time_range.start)
    if queued and device:
        sleep, device = device[0], device[1:]
        last = max((e.time_range.end for e in device), default=math.nan)
        return device, host, last - sleep.time_range.end
    return device, host, end - start


def _table(by_name: dict[str, list[float]], calls: int) -> list[dict[str, Any]]:
    """{name: [count, total us]} -> rows {name, calls, us, share} per op call, largest first, capped."""
    total = sum(us for _, us in by_name.values()) or math.nan
    rows = sorted(({"name": n, "calls": c / calls, "us": us / calls, "share": us / total}
                   for n, (c, us) in by_name.items()), key=lambda r: -r["us"])
    if len(rows) > PROFILE_KEEP:
        rest = rows[PROFILE_KEEP - 1:]
        rows = rows[:PROFILE_KEEP - 1] + [{
            "name": f"(other {len(rest)})", "calls": sum(r["calls"] for r in rest),
            "us": sum(r["us"] for r in rest), "share": sum(r["share"] for r in rest)}]
    return rows


def reduce_events(events: Sequence[Any], calls: int, on_device: bool, queued: bool = False) -> dict[str, Any]:
    """A profiler's events -> the per-op-call breakdown (JSON-able).

    On a GPU: device activity by `short_name`, `busy_us` the union of its intervals (time the GPU
    ran something for this call; overlapping streams count once), `kernel_us` their plain sum.
    On CPU: host ops by self time (nested ops counted once), `busy_us` the union of their intervals.
    `launches` is host launch calls (kernel and graph launches) per op call; `window_us` the
    profiled wall time per op call (`_in_window`; on CPU profiler overhead included).
    """
    device, host, window = _in_window(events, queued)
    by_name: dict[str, list[float]] = {}
    if on_device:
        spans = [(e.time_range.start, e.time_range.end) for e in device]
        for e in device:
            entry = by_name.setdefault(short_name(e.name), [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    else:
        spans = [(e.time_range.start, e.time_range.end) for e in host]
        for e in host:
            entry = by_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.self_cpu_time_total
    launches = sum(1 for e in host if any(k in e.name for k in _LAUNCH_NAMES)) - (1 if queued else 0)
    return {"calls": calls, "busy_us": _union_us(spans) / calls,
            "kernel_us": sum(us for _, us in by_name.values()) / calls,
            "window_us": window / calls, "launches": launches / calls,
            "kernels": _table(by_name, calls)}


def _op_calls(world: World, op: Any, problem: Any, runner: Callable) -> list[Callable[[], Any]]:
    """The callables the bench times (as measure.measure makes them): one per input set, rotated
    against L2 on GPUs, each writing into its own preallocated output."""
    from autofuse.measure.timing import nbytes, rotation_count

    sets = rotation_count(nbytes(op.inputs(world, problem, 0))) if world.device.type == "cuda" else 1
    inputs = [op.inputs(world, problem, 1 + i) for i in range(sets)]
    outs = [runner(*x) for x in inputs]
    return [lambda x=x, o=o: runner(*x, out=o) for x, o in zip(inputs, outs)]


def _sleep_us(world: World, host_us: float) -> float:
    """How long each GPU sleeps before the profiled calls (collective: the ranks agree on the longest).

    The profiler slows the host (each launch and op is recorded), so without a sleep an eager loop
    turns host-bound: kernels would start as they are launched, and a collective kernel would count
    the time it waits for a peer whose host is behind. Queued behind the sleep, the calls run back
    to back as when the bench times them. `host_us`: the host's time to issue them, unprofiled; the
    sleep lasts several times that, within [2 ms, 200 ms].
    """
    return min(200e3, max(2e3, QUEUE_AHEAD_FACTOR * world.rank_max(host_us)))


def _queue_ahead(sleep_us: float) -> bool:
    """Put a sleep kernel of `sleep_us` on the current stream; whether one was put (torch.cuda._sleep exists)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return False
    sleep(int(sleep_us * 1e-6 * _SLEEP_HZ))
    return True


def _traced(world: World, run: Callable[[], None], steps: int, sleep_us: float) -> tuple[Any, bool]:
    """`run` `steps` times under torch.profiler on every rank, the calls inside one MARK range.

    A barrier inside the profiler, before the range, lines the ranks up after the profiler's start
    (its first start can take a while on one rank). On GPUs the range opens with a sleep kernel
    (`_sleep_us`), the first device work in it, and closes with a device sync.
    Returns (profiler, whether a sleep was queued).
    """

    cuda = world.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():  # torch 2.11 warns that a profiler keeps one cycle: that is all there is
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with torch.profiler.profile(activities=activities) as prof:
            world.sync()
            with torch.profiler.record_function(MARK):
                queued = cuda and _queue_ahead(sleep_us)
                for _ in range(steps):
                    run()
                if cuda:
                    torch.cuda.synchronize(world.device)
    return prof, queued


def profile_calls(world: World, fns: Sequence[Callable[[], Any]], mode: str, calls: int = PROFILE_CALLS,
                  warmup: int = PROFILE_WARMUP) -> dict[str, Any]:
    """Run `fns` (each one call; in graph mode captured together in one CUDA graph, replayed) about
    `calls` times under torch.profiler on every rank; rank 0 returns the per-call breakdown
    (`reduce_events`), other ranks {}. Raises what a call raises. Every rank must call it alike:
    the calls may hold collectives."""
    from autofuse.measure.timing import capture

    def step() -> None:
        for f in fns:
            f()

    run = capture(world, step).replay if mode == "graph" else step
    steps = max(1, math.ceil(calls / len(fns)))
    world.sync()
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        run()
    sleep_us = _sleep_us(world, (time.perf_counter() - t0) * 1e6 / max(1, warmup) * steps)
    world.sync()
    prof, queued = _traced(world, run, steps, sleep_us)
    if world.rank != 0:
        return {}
    return reduce_events(prof.events(), steps * len(fns), world.device.type == "cuda", queued)


def profile_variant(world: World, op: Any, problem: Any, variant: str, config: dict, mode: str,
                    latency_us: float, calls: int = PROFILE_CALLS, warmup: int = PROFILE_WARMUP) -> dict[str, Any]:
    """Profile one (problem, variant, config) in `mode` on every rank; rank 0 returns the breakdown.

    Every rank must call it with the same arguments. Returns {mode, config, latency_us (the bench's
    measured median, for comparison), calls, busy_us, kernel_us, window_us, launches, kernels} on
    rank 0 (other ranks: the same keys without the reduction), or {mode, config, error} on every
    rank when any rank failed; a failure never raises.
    """
    from autofuse.measure.timing import check_faults, rebuild_workspaces

    head = {"mode": mode, "config": dict(config), "latency_us": latency_us}
    error, result = "", {}
    try:
        runner = op.variant(variant).build(world, problem, config)
        result = profile_calls(world, _op_calls(world, op, problem, runner), mode, calls, warmup)
        check_faults(world, runner)
    except Exception as exc:  # a profile that breaks is reported in the result, never fails the bench
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    if world.rank_max(1.0 if error else 0.0) > 0:
        rebuild_workspaces(world)
        return {**head, "error": error or "failed on another rank"}
    return {**head, **result}


# ---------------------------------------------------------------------------------------------
# rendering

PROFILE_TOP = 8  # kernels shown per variant in the printed table (the JSON keeps PROFILE_KEEP)


def _num(x: Any, digits: int = 1) -> str:
    """A number for a table cell: '-' when missing or not finite."""
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}f}"


def _count(x: Any) -> str:
    """Calls per op call: as few decimals as it needs (1, 0.5, 0.05)."""
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.2f}".rstrip("0").rstrip(".")


def _share(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.0%}"


def summary_line(variant: str, got: dict[str, Any], device_kind: str = "cuda") -> str:
    """The profile's totals for people: measured latency, busy time and the rest, launches per call.

    On a GPU, "idle" (measured minus busy) is the time no kernel of the call ran: launch tax and
    gaps between kernels. On CPU, busy is the time in torch ops; the rest is mostly the interpreter.
    """
    if "error" in got:
        return f"  {variant}: profile failed: {got['error']}"
    lat, busy = (x if isinstance(x, (int, float)) else math.nan for x in (got.get("latency_us"), got.get("busy_us")))
    share = f" ({busy / lat:.0%})" if lat and math.isfinite(lat) and math.isfinite(busy) else ""
    if device_kind != "cuda":
        return (f"  {variant}: measured {_num(lat)} us/call; in CPU ops {_num(busy)} us{share}, outside ops "
                f"{_num(lat - busy)} us; profiled {_num(got['window_us'])} us/call")
    return (f"  {variant}: measured {_num(lat)} us/call; GPU busy {_num(busy)} us{share}, idle "
            f"{_num(lat - busy)} us; kernels sum {_num(got['kernel_us'])} us; "
            f"{_count(got['launches'])} launches/call; profiled {_num(got['window_us'])} us/call")


def render_profile(row: dict[str, Any], device_kind: str, console: Any, top: int = PROFILE_TOP) -> None:
    """One bench row's profiles: a table of each variant's top kernels (per op call), then its totals.

    The kernel column folds long names instead of truncating them, so the table fits 80 columns.
    """
    from rich.table import Table

    what = "GPU kernels" if device_kind == "cuda" else "CPU ops by self time"
    console.print(f"profile of {row['problem']}, {row['mode']} mode: {what} per op call "
                  f"(top {top} per variant)", style="bold", soft_wrap=False)
    t = Table()
    t.add_column("variant", no_wrap=True)
    t.add_column("kernel", overflow="fold")
    for name in ("calls", "us", "share"):
        t.add_column(name, justify="right", no_wrap=True)
    for variant, got in row["profile"].items():
        kernels = [] if "error" in got else got["kernels"][:top]
        for j, k in enumerate(kernels):
            t.add_row(variant if j == 0 else "", k["name"], _count(k["calls"]), _num(k["us"]), _share(k["share"]))
    console.print(t)
    for variant, got in row["profile"].items():
        console.print(summary_line(variant, got, device_kind))
