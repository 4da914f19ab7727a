"""Host time per call of each autofuse custom op of a training step, split into library, dispatch and runner.

A compiled training step (torch.compile of `autofuse.nn.llama.parallelize_layer(..., sequence_parallel=True)`)
runs every autofuse call as `torch.ops.autofuse.<op>` under no grad, forward and backward, so its host
cost per call is: torch's custom-op machinery (its Python autograd kernel, redispatch, the backend
wrapper) -> autofuse's custom-op implementation (autofuse/library/custom.py) -> dispatch's entry
(autofuse/dispatch/entry.py: key, cache lookup, checks) -> the runner. This script records the calls of one
eager forward + backward of a Llama decoder layer (a TorchDispatchMode sees each custom op with its phase
and real arguments), then, with every decision cached, times each distinct call (op, phase, shapes) on
every rank (rank-max of medians, time.perf_counter) at four depths:
- `op`:      the custom op itself, `torch.ops.autofuse.<op>.default(...)` under no grad (what the graph runs);
- `impl`:    autofuse's implementation function the custom op registered (custom.py's `impl`);
- `entry`:   the dispatch entry the implementation calls (`autofuse.dispatch.entry.library_call`; before it
             existed, `autofuse.dispatch.call`);
- `runner`:  the cached runner called directly.
The first three run against a stub runner (the cached runner's own class and state, its `__call__`
returning a kept output: no compute, no collective), so the differences are host work alone:
torch = op - impl, library = impl - entry, dispatch = entry - stub. `runner` is the real runner
(on CPU: gloo + a CPU matmul; AUTOFUSE_VARIANT=bsp by default there, so it is cheap). Shares: each
row's per-layer count x (torch + library + dispatch) over the layer's sum. A cProfile of every recorded
call of a layer (stub runners) lists the top functions by own time.

    python3 scripts/host_profile_train.py                       # CPU: 2 ranks, gloo, tiny layer, bsp
    python3 scripts/host_profile_train.py --model 8b --tokens 2048 --variant '' --out host_train.json   # GPUs
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Callable

import torch

CALLS = 100  # calls per sample of the stubbed depths (no device work: host time alone)
RUNNER_CALLS = 20  # calls per sample of the real runner


def _host_us(world: Any, fns: dict[str, Callable[[], Any]], calls: int, samples: int = 15) -> dict[str, float]:
    """Median host us per call of each of `fns`, rank-max; the functions take turns within each sample, so
    a burst of load from elsewhere on the host hits all of them alike. GPUs: issued behind a sleep kernel,
    so the host never waits on the device."""
    cuda = world.device.type == "cuda"
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(samples):
        for k, fn in fns.items():
            world.sync()
            if cuda:
                torch.cuda._sleep(int(2e8))
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[k].append((time.perf_counter() - t0) * 1e6 / calls)
            if cuda:
                torch.cuda.synchronize()
    return {k: world.rank_max(sorted(v)[len(v) // 2]) for k, v in out.items()}


def _record(world: Any, cfg: dict) -> list[dict]:
    """The autofuse custom-op calls of one eager forward + backward of the layer, in order, with phase."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    from autofuse.bench.bench_train_layer import MODELS
    from autofuse.nn.llama import parallelize_layer

    dev, dtype = world.device, (torch.bfloat16 if world.device.type == "cuda" else torch.float32)
    config = LlamaConfig(**MODELS[cfg["model"]], num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-5,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = parallelize_layer(LlamaDecoderLayer(config, 0).to(dev, dtype), world.group, sequence_parallel=True)
    t = cfg["tokens"]
    x = torch.randn(1, t // world.size, config.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    pos = torch.arange(t, device=dev)[None]
    pe = LlamaRotaryEmbedding(config).to(dev)(x, pos)
    calls: list[dict] = []

    class Record(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "autofuse":
                calls.append({"phase": self.phase, "func": func,
                              "args": tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                              "kwargs": dict(kwargs)})
            return func(*args, **kwargs)

    def step(mode: Any = None) -> None:
        if mode is not None:
            mode.phase = "forward"
        y = layer(x, position_embeddings=pe, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        if mode is not None:
            mode.phase = "backward"
        y.backward(torch.ones_like(y))

    step()  # first calls: every decision made, agreed and cached
    with Record() as mode:
        step(mode)
    return calls


def _stub(runner: Any, out: Any) -> Any:
    """A runner of the cached runner's class and state whose call returns `out` (no compute, no collective):
    what the custom op's extras (`Extra.take`) read of the runner still works."""
    cls = type(runner)
    stub = object.__new__(type(f"Stub{cls.__name__}", (cls,), {"__call__": lambda self, *a, out=None: self._kept}))
    stub.__dict__.update(runner.__dict__)
    stub._kept = out
    return stub


def _split(calls: list[dict]) -> list[dict]:
    """Distinct (phase, op, shapes) with their count per layer, in first-seen order."""
    rows: dict[tuple, dict] = {}
    for c in calls:
        shapes = tuple(tuple(a.shape) for a in c["args"] if isinstance(a, torch.Tensor))
        key = (c["phase"], c["func"].name(), shapes)
        if key in rows:
            rows[key]["count"] += 1
        else:
            rows[key] = {**c, "count": 1, "shapes": shapes}
    return list(rows.values())


def _base(qualname: str) -> tuple[str, Any]:
    """(op name, its Op) of a custom op's name (`ag_gemm_gathered` -> ag_gemm)."""
    from autofuse.library import custom

    name = qualname.split("::")[-1]
    for op_name, op in custom.OPS.items():
        if name == op_name or (name.startswith(op_name + "_") and name[len(op_name) + 1:] in op.custom.extras):
            return op_name, op
    raise KeyError(name)


def entry_of(name: str, tensors: tuple, group: Any, variant: str | None, config: str | None) -> Callable[[], Any]:
    """The dispatch entry the custom ops' implementations call: `dispatch.entry.library_call` where there is
    one, else (autofuse before it) `dispatch.call`."""
    from autofuse.dispatch import entry

    if hasattr(entry, "library_call"):
        return lambda: entry.library_call(name, tensors, group, variant, config)
    parsed = None if config is None else json.loads(config)
    return lambda: entry.call(name, *tensors, group=group, variant=variant, config=parsed)


def _measure(world: Any, r: dict, real_runners: dict[int, tuple]) -> dict:
    """One distinct call's row: its cached runner timed, then the custom op, the implementation and the
    dispatch entry against a stub of it (left in place; `real_runners` keeps the real one)."""
    import autofuse
    from autofuse.dispatch.entry import key_of
    from autofuse.dispatch.state import STATE
    from autofuse.library import custom
    from autofuse.library.groups import group_of

    func, args, kwargs = r["func"], r["args"], r["kwargs"]
    qual = func.name().split("::")[-1]
    name, op = _base(qual)
    n = len(op.args)
    tensors, group = args[:n], group_of(args[n])
    variant, text = kwargs.get("variant"), kwargs.get("config")
    config = None if text is None else json.loads(text)
    entry = STATE.cache[key_of(name, group, variant, config, tensors)]
    runner = real_runners.setdefault(id(entry), (entry, entry.runner))[1]

    def real() -> Any:
        return runner(*tensors)

    with torch.no_grad():
        runner_us = _host_us(world, {"runner": real}, RUNNER_CALLS)["runner"]
        stub = entry.runner = _stub(runner, real())
    impl = custom.IMPLS[qual]
    depth = {"op": lambda: func(*args, **kwargs), "impl": lambda: impl(*args, **kwargs),
             "entry": entry_of(name, tensors, group, variant, text), "stub": lambda: stub(*tensors)}
    with torch.no_grad():
        us = _host_us(world, depth, CALLS)
    # the eager training path of a forward call: the public entry point on inputs that require grad
    # (route, the custom op's autograd node and setup_context), what an uncompiled step pays
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    public = getattr(autofuse, name)

    def eager() -> Any:
        return public(*leaves, group=group, variant=variant, config=config)

    eager_us = _host_us(world, {"eager": eager}, CALLS)["eager"] if r["phase"] == "forward" else None
    row = {"op": qual, "phase": r["phase"], "shapes": [list(s) for s in r["shapes"]], "count": r["count"],
           "variant": entry.choice.variant, "runner_us": runner_us,
           "torch_us": us["op"] - us["impl"], "library_us": us["impl"] - us["entry"],
           "dispatch_us": us["entry"] - us["stub"], "stub_us": us["stub"], "op_us": us["op"], "eager_us": eager_us}
    row["host_us"] = row["torch_us"] + row["library_us"] + row["dispatch_us"]
    return row


def _rank(world: Any, cfg: dict) -> dict:
    if world.device.type != "cuda":
        torch.set_num_threads(1)
    if cfg["variant"] is not None:
        os.environ["AUTOFUSE_VARIANT"] = cfg["variant"]
    rows = _split(_record(world, cfg))
    result: dict[str, Any] = {"rows": [], "cprofile": ""}
    real_runners: dict[int, tuple] = {}  # id(entry) -> (entry, its runner): rows of one problem share one entry
    for r in rows:
        result["rows"].append(_measure(world, r, real_runners))
    prof = cProfile.Profile()
    world.sync()
    with torch.no_grad():
        prof.enable()
        for _ in range(50):
            for r in rows:
                r["func"](*r["args"], **r["kwargs"])
        prof.disable()
    for entry, runner in real_runners.values():
        entry.runner = runner
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    result["cprofile"] = text.getvalue()
    layer = sum(r["count"] * r["host_us"] for r in result["rows"])
    for r in result["rows"]:
        r["share"] = r["count"] * r["host_us"] / layer if layer else 0.0
    result["layer_host_us"] = layer
    result["layer_calls"] = sum(r["count"] for r in result["rows"])
    return result


def render(res: dict) -> str:
    head = (f"{'op':18s} {'phase':8s} {'n':>2s} {'variant':8s} {'torch':>7s} {'library':>8s} {'dispatch':>9s} "
            f"{'host':>7s} {'runner':>8s} {'share':>6s} {'eager':>7s}   (us per call, median, rank-max)")
    lines = [head]
    for r in res["rows"]:
        lines.append(f"{r['op']:18s} {r['phase']:8s} {r['count']:2d} {r['variant']:8s} {r['torch_us']:7.1f} "
                     f"{r['library_us']:8.1f} {r['dispatch_us']:9.1f} {r['host_us']:7.1f} {r['runner_us']:8.1f} "
                     f"{r['share']:6.1%} " + (f"{r['eager_us']:7.1f}" if r["eager_us"] is not None else f"{'-':>7s}"))
    lines.append(f"per layer: {res['layer_calls']} calls, {res['layer_host_us']:.1f} us of host work outside the "
                 "runners (torch + library + dispatch); eager: the public entry point with inputs that require "
                 "grad (forward only, stub runner)")
    return "\n".join(lines)


def main() -> None:
    from autofuse.comm.world import default_device_kind, gpu_count, spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="autofuse.bench.bench_train_layer.MODELS: 8b | 70b | tiny "
                                                  "(default tiny on CPU, 8b on GPUs)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of the sequence (default 16 on CPU, 2048 on GPUs)")
    ap.add_argument("--world", type=int, default=None, help="ranks (default 2)")
    ap.add_argument("--variant", default=None, help="AUTOFUSE_VARIANT for the run (default *:bsp on CPU, the "
                                                     "environment's on GPUs; '' for the policy)")
    ap.add_argument("--out", default=os.path.join("autofuse-out", "host_profile_train.json"),
                    help="JSON output (default: ./autofuse-out/host_profile_train.json, where the commands write)")
    a = ap.parse_args()
    kind = default_device_kind()
    cpu = kind == "cpu"
    cfg = {"model": a.model or ("tiny" if cpu else "8b"), "tokens": a.tokens or (16 if cpu else 2048),
           "variant": a.variant if a.variant is not None else ("*:bsp" if cpu else None)}
    world = a.world or 2
    if not cpu and world > gpu_count():
        sys.exit(f"--world {world}: only {gpu_count()} GPUs")
    res = spawn(_rank, world, cfg, device_kind=kind, timeout_s=1800)[0]
    out = {"args": cfg, "world": world, "device": torch.cuda.get_device_name() if not cpu else "cpu",
           "cpus": os.cpu_count(), **res}
    print(render(out))
    print(res["cprofile"])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
