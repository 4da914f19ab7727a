"""Runtime dispatch: `autofuse.ag_gemm(a, b, group=...)` and friends run the variant the policy picks.

Hot path (a cached problem): a key from the op name, the group and each input's shape, dtype,
device and contiguity, one dict lookup, the runner call. No I/O, no collective, no policy walk.

Miss path (a problem this process has not seen, per op/group/shapes): the op's `problem_of`
validates the inputs; the decision comes from, in order, the `variant=` argument,
`AUTOFUSE_VARIANT=op:variant,...` (`*:variant` for every op), the policy. The policy is
`AUTOFUSE_POLICY` (a JSON path), else the file in `models/` whose fingerprint matches this machine
(preferring `AUTOFUSE_MODE`, default graph on GPUs), else BSP for everything with a one-time
warning. Every rank then all-gathers a hash of (problem, variant, config); a mismatch raises
`DispatchMismatch` naming each rank's choice before any kernel is built or launched (so no rank
waits in NCCL while another spins on a flag). Then the runner is built and cached.

CUDA graphs: a cached problem is safe to capture (the runner keeps its epochs on the device). A
miss during capture raises `CaptureMiss`: building a runner allocates heap workspace collectively
and the rank check is a collective, neither of which may run inside a capture; call each problem
once before capturing (warm-up), as inference servers already do.

Flag timeouts: on CPU `status.check` runs after every fused call; on GPUs after the first call of
a problem (it synchronises) and after every call when AUTOFUSE_CHECK=1 (read per new problem).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import Config, InvalidConfig, Op, Problem, config_key
from autofuse.world import World


class DispatchMismatch(RuntimeError):
    """Ranks chose different variants/configs (or saw different problems) for the same call."""


class CaptureMiss(RuntimeError):
    """A problem was first seen inside CUDA-graph capture, where dispatch cannot decide it."""


@dataclass
class Stats:
    """Counters of this process's dispatch (tests assert on them; `reset()` zeroes them)."""

    hits: int = 0
    misses: int = 0
    collectives: int = 0
    policy_loads: int = 0
    builds: int = 0
    checks: int = 0


@dataclass
class Choice:
    """Which variant and config run a problem, and why (what `explain` returns)."""

    op: str
    problem: Problem
    variant: str
    config: Config
    reason: str
    source: str  # override | env | measured | policy | unsure | fallback
    policy: str = ""
    config_source: str = ""
    cached: bool = False

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.problem.key}",
                 f"  variant: {self.variant}",
                 f"  config:  {config_key(self.config)}" + (f"  ({self.config_source})" if self.config_source else ""),
                 f"  why:     [{self.source}] {self.reason}"]
        if self.policy:
            lines.append(f"  policy:  {self.policy}")
        if self.cached:
            lines.append("  (cached decision of this process)")
        return "\n".join(lines)


class _Entry:
    __slots__ = ("runner", "choice", "check", "heap", "op")

    def __init__(self, runner: Any, choice: Choice, check: bool, heap: Any, op: str):
        self.runner, self.choice, self.check, self.heap, self.op = runner, choice, check, heap, op


stats = Stats()
_cache: dict[tuple, _Entry] = {}
_worlds: dict[int, tuple[Any, World]] = {}
_ops: dict[str, Op] = {}
_policies: dict[str, Any] = {}
_forced_policy: Any = None
_warned: set[str] = set()


# ---------------------------------------------------------------------------------------------
# public entry points


def call(op: str | Op, *args: Any, group: Any = None, variant: str | None = None, config: Config | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Run `op` on this rank's inputs with the chosen (or overridden) variant; every rank must call it.

    `group`: a torch.distributed process group (None: the default group) or an autofuse World.
    """
    name = op if op.__class__ is str else op.name
    return _run(_key(name, group, variant, config, args), op, args, group, variant, config, out)


# The entry points below build the same key as `_key`, spelled out: they are the hot path.


def ag_gemm(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """all_gather_rows(a) @ b over `group`: rank r holds A_r (M/W x K) and B_r (K x N_r)."""
    key = ("ag_gemm", id(group), variant, None if config is None else config_key(config),
           a.shape, a.dtype, a.device, a.is_contiguous(), b.shape, b.dtype, b.device, b.is_contiguous())
    return _run(key, "ag_gemm", (a, b), group, variant, config, out)


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """reduce_scatter_rows(a @ b) over `group`: rank r holds A_r (M x K/W) and B_r (K/W x N)."""
    key = ("gemm_rs", id(group), variant, None if config is None else config_key(config),
           a.shape, a.dtype, a.device, a.is_contiguous(), b.shape, b.dtype, b.device, b.is_contiguous())
    return _run(key, "gemm_rs", (a, b), group, variant, config, out)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """all_reduce(a @ b) over `group`: rank r holds A_r (M x K/W) and B_r (K/W x N)."""
    key = ("gemm_ar", id(group), variant, None if config is None else config_key(config),
           a.shape, a.dtype, a.device, a.is_contiguous(), b.shape, b.dtype, b.device, b.is_contiguous())
    return _run(key, "gemm_ar", (a, b), group, variant, config, out)


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, group: Any = None, *,
                 variant: str | None = None, config: Config | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q over a KV cache split along the sequence across `group`'s ranks."""
    key = ("flash_decode", id(group), variant, None if config is None else config_key(config),
           q.shape, q.dtype, q.device, q.is_contiguous(), k.shape, k.dtype, k.device, k.is_contiguous(),
           v.shape, v.dtype, v.device, v.is_contiguous(), lengths.shape, lengths.dtype, lengths.device,
           lengths.is_contiguous())
    return _run(key, "flash_decode", (q, k, v, lengths), group, variant, config, out)


def explain(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
            config: Config | None = None) -> Choice:
    """Which variant and config `op(*args)` runs with, and why; builds nothing, no collective.

    Returns this process's cached decision where there is one; `str()` of the result reads well.
    """
    name = op if isinstance(op, str) else op.name
    key = _key(name, group, variant, config, args)
    entry = _cache.get(key)
    if entry is not None:
        c = entry.choice
        return Choice(c.op, c.problem, c.variant, dict(c.config), c.reason, c.source, c.policy, c.config_source, True)
    return _decide(_get_op(op), _world(group), args, variant, config)


def runner_of(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
              config: Config | None = None) -> Any:
    """The runner a cached call of `op(*args)` runs (to call it without dispatch, e.g. to time dispatch).

    Raises LookupError if these shapes have not been called yet in this process.
    """
    name = op if isinstance(op, str) else op.name
    key = _key(name, group, variant, config, args)
    entry = _cache.get(key)
    if entry is None:
        raise LookupError(f"autofuse.{name}: no cached decision for these arguments; call it once first")
    return entry.runner


def set_policy(policy: Any) -> None:
    """Use `policy` (a Policy, a JSON path, or None to go back to the default search) from now on.

    Clears cached decisions: every rank must call it alike.
    """
    global _forced_policy
    if policy is not None and not hasattr(policy, "decide"):
        from autofuse.policy import Policy

        policy = Policy.load(policy)
    _forced_policy = policy
    _policies.clear()
    _cache.clear()


def reset() -> None:
    """Forget cached decisions, runners, Worlds, policies, warnings and counters (tests)."""
    global _forced_policy
    _cache.clear()
    _worlds.clear()
    _ops.clear()
    _policies.clear()
    _warned.clear()
    _forced_policy = None
    for f in stats.__dataclass_fields__:
        setattr(stats, f, 0)


# ---------------------------------------------------------------------------------------------
# the miss path


def _key(name: str, group: Any, variant: str | None, config: Config | None, args: tuple) -> tuple:
    """The cache key: op, group, overrides, and each input's shape, dtype, device and contiguity.

    Contiguity rather than strides: ops that need contiguous inputs reject the others in
    `problem_of` (a new key is a miss, so it runs); ops that take strides read them per call.
    """
    key = [name, id(group), variant, None if config is None else config_key(config)]
    for a in args:
        if isinstance(a, torch.Tensor):
            key += (a.shape, a.dtype, a.device, a.is_contiguous())
        else:
            key.append(a)
    return tuple(key)


def _run(key: tuple, op: str | Op, args: tuple, group: Any, variant: str | None, config: Config | None,
         out: torch.Tensor | None) -> torch.Tensor:
    entry = _cache.get(key)
    if entry is None:
        return _miss(key, op, args, group, variant, config, out)
    stats.hits += 1
    result = entry.runner(*args) if out is None else entry.runner(*args, out=out)
    if entry.check:
        _check(entry)
    return result


def _miss(key: tuple, op: str | Op, args: tuple, group: Any, variant: str | None, config: Config | None,
          out: torch.Tensor | None) -> torch.Tensor:
    op = _get_op(op)
    if _capturing(args):
        raise CaptureMiss(
            f"autofuse.{op.name}: these shapes were first seen inside CUDA-graph capture; dispatch must build "
            "the kernels, allocate heap workspace and check that every rank chose the same variant, which "
            "cannot run during capture. Call it once with the same shapes before capturing (warm-up).")
    stats.misses += 1
    world = _world(group)
    choice = _decide(op, world, args, variant, config)
    _verify_same(world, choice)
    v = op.variant(choice.variant)
    runner = v.build(world, choice.problem, choice.config)
    stats.builds += 1
    every = v.fused and (world.device.type == "cpu" or os.environ.get("AUTOFUSE_CHECK") == "1")
    entry = _Entry(runner, choice, every, world.heap if v.fused else None, op.name)
    _cache[key] = entry
    result = runner(*args) if out is None else runner(*args, out=out)
    if v.fused:
        _check(entry)
    return result


def _decide(op: Op, world: World, args: tuple, variant: str | None, config: Config | None) -> Choice:
    problem = op.problem_of(world, *args)
    available = [n for n, v in op.variants.items() if v.available(world)]
    if variant is None and config is not None:
        raise ValueError(f"autofuse.{op.name}: config= needs variant= (a config belongs to one variant)")
    source, reason = "override", f"override: variant={variant!r} argument"
    if variant is None:
        variant = _env_override(op.name)
        source, reason = "env", f"override: AUTOFUSE_VARIANT={os.environ.get('AUTOFUSE_VARIANT', '')}"
    if variant is not None:
        v = op.variant(variant)
        if variant not in available:
            raise ValueError(f"autofuse.{op.name}: variant {variant!r} ({reason}) is not available on "
                             f"{world.device.type}; available: {available}")
        if config is None:
            config, config_source = _policy(world).config_for(problem, variant, op)
            if config is None:
                raise InvalidConfig(f"{op.name}.{variant}: no config accepts {problem.key}")
        else:
            config, config_source = dict(config), "override: config= argument"
            why = v.check(problem, config)
            if why:
                raise InvalidConfig(f"{op.name}.{variant} cannot run {problem.key} with {config_key(config)}: {why}")
        return Choice(op.name, problem, variant, config, reason, source, _policy(world).source, config_source)
    policy = _policy(world)
    d = policy.decide(problem, op, available)
    return Choice(op.name, problem, d.variant, d.config, d.reason, d.kind, policy.source, d.config_source)


def _verify_same(world: World, choice: Choice) -> None:
    """All-gather a hash of (problem, variant, config); raise on any difference, before any launch."""
    if world.size == 1:
        return
    text = f"{choice.problem.key}|{choice.variant}|{config_key(choice.config)}"
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([h], dtype=torch.int64, device=world.device)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine, group=world.group)
    stats.collectives += 1
    if len({int(t.item()) for t in every}) == 1:
        return
    said: list[Any] = [None] * world.size
    dist.all_gather_object(said, f"{choice.variant} {config_key(choice.config)} for {choice.problem.key} "
                           f"([{choice.source}] {choice.reason})", group=world.group)
    stats.collectives += 1
    lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(said))
    raise DispatchMismatch(
        f"autofuse.{choice.op}: ranks disagree on what to run, so nothing was launched:\n{lines}\n"
        "Give every rank the same policy (AUTOFUSE_POLICY / models/), the same AUTOFUSE_VARIANT and "
        "variant=/config= arguments, and the same input shapes.")


def _check(entry: _Entry) -> None:
    if entry.heap.world.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    stats.checks += 1
    status.check(entry.heap, entry.op)


def _capturing(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()


def _get_op(op: str | Op) -> Op:
    if not isinstance(op, str):
        return op
    if op not in _ops:
        from autofuse import registry

        try:
            _ops[op] = registry.get(op)
        except ModuleNotFoundError as exc:
            raise NotImplementedError(f"autofuse.{op} is not available in this installation ({exc})") from None
    return _ops[op]


def _world(group: Any) -> World:
    if isinstance(group, World):
        return group
    got = _worlds.get(id(group))
    if got is None:
        got = _worlds[id(group)] = (group, World.from_group(group))  # holding `group` keeps its id unique
    return got[1]


def _env_override(op: str) -> str | None:
    text = os.environ.get("AUTOFUSE_VARIANT", "")
    chosen = None
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, variant = item.partition(":")
        if not sep or not variant:
            raise ValueError(f"AUTOFUSE_VARIANT={text!r}: items are op:variant (or *:variant), got {item!r}")
        if name == op or (name == "*" and chosen is None):
            chosen = variant
    return chosen


# ---------------------------------------------------------------------------------------------
# finding the policy


def models_dirs() -> list[Path]:
    """Where shipped policies are searched: AUTOFUSE_MODELS_DIR, models/ beside the package, installed data."""
    here = Path(__file__).resolve().parent
    dirs = [Path(p) for p in os.environ.get("AUTOFUSE_MODELS_DIR", "").split(os.pathsep) if p]
    dirs += [here.parent / "models", here / "models", Path(sys.prefix) / "share" / "autofuse" / "models"]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def find_policy(fingerprint: dict, mode: str | None = None) -> Path | None:
    """The shipped policy whose fingerprint matches (preferring `mode`), or None."""
    from autofuse.environment import fingerprint_id

    found: list[tuple[bool, str, Path]] = []
    for d in models_dirs():
        for path in sorted(d.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                fp = data["fingerprint"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(fp, dict) and fingerprint_id(fp) == fingerprint["id"]:
                found.append((data.get("mode") != mode, str(path), path))
    return min(found)[2] if found else None


def _policy(world: World) -> Any:
    kind = world.device.type
    if _forced_policy is not None:
        return _forced_policy
    if kind not in _policies:
        from autofuse import environment
        from autofuse.policy import Policy

        stats.policy_loads += 1
        fp = environment.fingerprint(kind)
        env = os.environ.get("AUTOFUSE_POLICY")
        mode = os.environ.get("AUTOFUSE_MODE") or ("graph" if kind == "cuda" else "eager")
        path = Path(env) if env else find_policy(fp, mode)
        if path is not None:
            _policies[kind] = Policy.load(path, fp)
        else:
            reason = (f"no policy for this machine (fingerprint {fp['id']}) in AUTOFUSE_POLICY or "
                      f"{', '.join(map(str, models_dirs())) or 'models/'}")
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"autofuse: {reason}; every op runs bsp. Tune and fit one: autofuse tune, "
                              "then autofuse fit.", RuntimeWarning, stacklevel=4)
            _policies[kind] = Policy.bsp(reason)
    return _policies[kind]
