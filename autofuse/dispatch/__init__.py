"""Runtime dispatch: `autofuse.ag_gemm(a, b, group=...)` and friends run the variant the policy picks.

Hot path (a cached problem): a key from the op name, the group and each input's shape, dtype,
device and contiguity, one dict lookup, the runner call. No I/O, no collective, no policy walk.

Entry points: `autofuse.<op>(*args, group=None, *, variant=None, config=None, out=None)` is
generated from the op's declared argument names (`Op.args`) the first time it is used, so an op
needs no hand-written entry point; the generated code builds the cache key inline.

Miss path (a problem this process has not seen, per op/group/shapes): the op's `problem_of`
validates the inputs; the decision comes from, in order, the `variant=` argument,
`AUTOFUSE_VARIANT=op:variant,...` (`*:variant` for every op), the policy. The policy is
`AUTOFUSE_POLICY` (a JSON path), else the file in `models/` whose fingerprint matches this machine
(preferring `AUTOFUSE_MODE`, default graph on GPUs), else BSP for everything with a one-time
warning. Then every rank agrees: each publishes its validation outcome and a hash of (problem,
variant, config) through the job's store and waits, bounded (the wait budget + 2 s), for all the
others. If any rank's input was invalid, every rank raises InvalidInput naming that rank and the
reason; if the choices differ, every rank raises DispatchMismatch naming each rank's choice; if a
rank does not take part (it ran a cached call with other shapes, or died), the others raise
DispatchMismatch when the wait runs out, while that rank's kernels time out on their flags. All
of it happens before any kernel is built or launched. Then the runner is built and cached.

CUDA graphs: a cached problem is safe to capture (the runner keeps its epochs on the device). A
miss during capture raises `CaptureMiss`: building a runner allocates heap workspace collectively
and the rank check is a collective, neither of which may run inside a capture; call each problem
once before capturing (warm-up), as inference servers already do.

Confirm on first use (autofuse/dispatch/confirm.py): when the decision for a problem rests on a prediction
(the policy never measured this problem, or the policy was fitted with other software), every rank
measures the policy's top candidates (AUTOFUSE_CONFIRM_K, default 3, plus BSP) on the caller's
inputs in lockstep, with the tuner's timer, and runs the fastest correct one (`explain` shows the
times and the cost, build and timing apart); the measurements go (source `online`) to this
machine's online store (AUTOFUSE_ONLINE_DB, default <user cache>/autofuse/online-<hardware id>.db),
which later processes read first (basis `confirmed`) and `autofuse fit` reads too. On by default
on GPUs, off on the CPU emulation; AUTOFUSE_ONLINE=0/1 switches it.

Faults: a runner refuses to run on a workspace that saw a fault (it reads a host-visible mirror of
the fault record, no device sync) until `autofuse.rebuild(group)` is called on every rank. The full
fault record is read (a device sync) after every call on CPU, after the first call of a problem on
GPUs, and after every call when AUTOFUSE_CHECK=1.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from autofuse.comm import status
from autofuse.core.op import Config, InvalidConfig, InvalidInput, Op, Problem, config_key
from autofuse.comm.world import World


class DispatchMismatch(RuntimeError):
    """Ranks chose different variants/configs, saw different problems, or did not all take part."""


class CaptureMiss(RuntimeError):
    """A problem was first seen inside CUDA-graph capture, where dispatch cannot decide it."""


@dataclass
class Stats:
    """Counters of this process's dispatch (tests assert on them; `reset()` zeroes them)."""

    hits: int = 0
    misses: int = 0
    agreements: int = 0
    policy_loads: int = 0
    builds: int = 0
    checks: int = 0
    confirmations: int = 0


@dataclass
class Choice:
    """Which variant and config run a problem, and why (what `explain` returns).

    basis: override | env | measured | confirmed | policy | unsure | fallback.
    """

    op: str
    problem: Problem
    variant: str
    config: Config
    reason: str
    basis: str
    policy_path: str = ""
    config_source: str = ""
    cached: bool = False
    candidates: list = field(default_factory=list)  # (variant, config) to confirm on first use
    confirmation: Any = None  # the confirm.Confirmation this decision came from (its costs, timings)

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.problem.key}",
                 f"  variant: {self.variant}",
                 f"  config:  {config_key(self.config)}" + (f"  ({self.config_source})" if self.config_source else ""),
                 f"  why:     [{self.basis}] {self.reason}"]
        if self.policy_path:
            lines.append(f"  policy:  {self.policy_path}")
        if self.cached:
            lines.append("  (cached decision of this process)")
        return "\n".join(lines)


class _Entry:
    """A cached decision: the runner, why it was chosen, whether to read the fault record every call."""

    __slots__ = ("runner", "choice", "check")

    def __init__(self, runner: Any, choice: Choice, check: bool):
        self.runner, self.choice, self.check = runner, choice, check


stats = Stats()
_cache: dict[tuple, _Entry] = {}
_worlds: dict[int, tuple[Any, World]] = {}
_ops: dict[str, Op] = {}
_policies: dict[str, Any] = {}
_forced_policy: Any = None
_warned: set[str] = set()
_agreement_seq: dict[str, int] = {}  # per group name; never reset, so store keys are never reused
_confirmed: dict[str, dict[str, dict]] = {}  # device kind -> problem key -> {variant: (us, config)} (online store)


# ---------------------------------------------------------------------------------------------
# public entry points


def call(op: str | Op, *args: Any, group: Any = None, variant: str | None = None, config: Config | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Run `op` on this rank's inputs with the chosen (or overridden) variant; every rank must call it.

    `group`: a torch.distributed process group (None: the default group) or an autofuse World.
    """
    name = op if op.__class__ is str else op.name
    key = _key(name, group, variant, config, args)
    entry = _cache.get(key)
    if entry is None:
        return _miss(key, op, args, group, variant, config, out)
    stats.hits += 1
    return _run(entry, args, out)


_ENTRY_TEMPLATE = """
def {name}({params}, group=None, *, variant=None, config=None, out=None):
    key = ({name!r}, id(group), variant, None if config is None else config_key(config), {key})
    entry = _cache.get(key)
    if entry is None:
        return _miss(key, {name!r}, ({params},), group, variant, config, out)
    stats.hits += 1
    result = entry.runner({params}) if out is None else entry.runner({params}, out=out)
    if entry.check:
        _check(entry)
    return result
"""


def entry_point(name: str) -> Callable[..., torch.Tensor]:
    """The public function `autofuse.<name>`, generated from the op's argument names (`Op.args`).

    Its body is the hot path: one key built inline from each argument's shape, dtype, device and
    contiguity, one dict lookup, the runner call. `_key` builds the same key for `call`/`explain`.
    """
    op = _get_op(name)
    params = ", ".join(op.args)
    key = " ".join(f"{a}.shape, {a}.dtype, {a}.device, {a}.is_contiguous()," for a in op.args)
    namespace = {"_cache": _cache, "_miss": _miss, "_check": _check, "stats": stats, "config_key": config_key}
    exec(_ENTRY_TEMPLATE.format(name=name, params=params, key=key), namespace)  # noqa: S102 - our own template
    fn = namespace[name]
    fn.__doc__ = (f"{op.description}.\n\nEvery rank of `group` (None: the default group) calls it with its own "
                  f"({params}); `variant=`/`config=` force a choice, `out=` is written in place.")
    fn.__module__ = "autofuse"
    fn.__qualname__ = name
    return fn


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
        return Choice(c.op, c.problem, c.variant, dict(c.config), c.reason, c.basis, c.policy_path, c.config_source,
                      True, confirmation=c.confirmation)
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


def rebuild(group: Any = None) -> None:
    """Clear every fault of `group`'s workspaces so they compute again (collective: every rank calls it).

    After a FlagTimeout or WorkspaceAborted, fix what made a rank late or absent, then call this on
    every rank; cached decisions stay.
    """
    from autofuse.comm.workspace import workspaces

    world = _world(group)
    for ws in workspaces(world):
        ws.rebuild()
    world.sync()


def set_policy(policy: Any) -> None:
    """Use `policy` (a Policy, a JSON path, or None to go back to the default search) from now on.

    Clears cached decisions: every rank must call it alike.
    """
    global _forced_policy
    if policy is not None and not hasattr(policy, "decide"):
        from autofuse.dispatch.policy import Policy

        policy = Policy.load(policy)
    _forced_policy = policy
    _policies.clear()
    _confirmed.clear()
    _cache.clear()


def reset() -> None:
    """Forget cached decisions, runners, Worlds, policies, warnings and counters (tests)."""
    global _forced_policy
    _cache.clear()
    _worlds.clear()
    _ops.clear()
    _policies.clear()
    _warned.clear()
    _confirmed.clear()
    _forced_policy = None
    for f in stats.__dataclass_fields__:
        setattr(stats, f, 0)


# ---------------------------------------------------------------------------------------------
# the hot path and the miss path


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


def _run(entry: _Entry, args: tuple, out: torch.Tensor | None) -> torch.Tensor:
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
    try:
        choice, invalid = _decide(op, world, args, variant, config), None
    except (InvalidInput, InvalidConfig, ValueError) as exc:
        choice, invalid = None, exc
    _agree(world, op.name, choice, invalid)
    if choice.candidates:
        choice = _confirm(world, op, choice, args)
    v = op.variant(choice.variant)
    runner = v.build(world, choice.problem, choice.config)
    stats.builds += 1
    every = bool(getattr(runner, "workspaces", ())) and (
        world.device.type == "cpu" or os.environ.get("AUTOFUSE_CHECK") == "1")
    entry = _Entry(runner, choice, every)
    _cache[key] = entry
    result = runner(*args) if out is None else runner(*args, out=out)
    _check(entry)
    return result


def _decide(op: Op, world: World, args: tuple, variant: str | None, config: Config | None) -> Choice:
    problem = op.problem_of(world, *args)
    available = [n for n, v in op.variants.items() if v.available(world)]
    if variant is None and config is not None:
        raise ValueError(f"autofuse.{op.name}: config= needs variant= (a config belongs to one variant)")
    basis, reason = "override", f"override: variant={variant!r} argument"
    if variant is None:
        variant = _env_override(op.name)
        basis, reason = "env", f"override: AUTOFUSE_VARIANT={os.environ.get('AUTOFUSE_VARIANT', '')}"
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
        return Choice(op.name, problem, variant, config, reason, basis, _policy(world).path, config_source)
    policy = _policy(world)
    confirmed = _confirmed_choice(op, world, problem, available, policy)
    if confirmed is not None:
        return confirmed
    d = policy.decide(problem, op, available)
    choice = Choice(op.name, problem, d.variant, d.config, d.reason, d.basis, policy.path, d.config_source)
    if not policy.needs_confirmation(problem, d):
        return choice
    if _online(world):
        choice.candidates = policy.candidates(problem, op, available, _confirm_k())
    elif problem.op in policy.stale_ops:
        config, source = policy.config_for(problem, "bsp", op)
        return Choice(op.name, problem, "bsp", config or {}, f"fallback: {policy.stale_ops[problem.op]}, and "
                      "confirmation on first use is off (AUTOFUSE_ONLINE=0 or the CPU emulation): bsp", "fallback",
                      policy.path, source)
    return choice


def _online(world: World) -> bool:
    """Whether first calls confirm predictions by measuring: AUTOFUSE_ONLINE, else on for GPUs."""
    text = os.environ.get("AUTOFUSE_ONLINE", "").strip()
    if text in ("0", "1"):
        return text == "1"
    if text:
        raise ValueError(f"AUTOFUSE_ONLINE={text!r}: use 1 (confirm predictions on first use) or 0")
    return world.device.type == "cuda"


def _confirm_k() -> int:
    text = os.environ.get("AUTOFUSE_CONFIRM_K", "3").strip()
    if not text.isdigit() or not 1 <= int(text) <= 16:
        raise ValueError(f"AUTOFUSE_CONFIRM_K={text!r}: a number of candidates in 1..16")
    return int(text)


def _mode(world: World) -> str:
    """The timing mode decisions are made for: AUTOFUSE_MODE, else graph on GPUs, eager on CPU."""
    mode = os.environ.get("AUTOFUSE_MODE") or ("graph" if world.device.type == "cuda" else "eager")
    if mode not in ("graph", "eager") or (mode == "graph" and world.device.type != "cuda"):
        raise ValueError(f"AUTOFUSE_MODE={mode!r}: use graph (GPUs) or eager")
    return mode


def online_db(fingerprint: dict) -> Path:
    """This machine's online store: AUTOFUSE_ONLINE_DB, else <user cache>/autofuse/online-<hardware id>.db."""
    env = os.environ.get("AUTOFUSE_ONLINE_DB")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "autofuse" / f"online-{fingerprint['hardware_id']}.db"


def _confirmed_choice(op: Op, world: World, problem: Problem, available: list[str], policy: Any) -> Choice | None:
    """The decision an earlier confirmation on this machine measured for `problem`, if any."""
    kind = world.device.type
    if kind not in _confirmed:
        _confirmed[kind] = _load_confirmed(world)
    measured = _confirmed[kind].get(problem.key)
    if not measured:
        return None
    ok = {v: m for v, m in measured.items() if v in available and op.variant(v).check(problem, m[1]) is None}
    if "bsp" not in ok:
        return None
    best = min(sorted(ok), key=lambda v: (ok[v][0], v != "bsp"))
    timed = ", ".join(f"{v} {t:.1f} us" for v, (t, _) in sorted(ok.items(), key=lambda x: x[1][0]))
    return Choice(op.name, problem, best, dict(ok[best][1]), f"confirmed: measured on this machine earlier ({timed})",
                  "confirmed", policy.path, "measured on first use")


def _load_confirmed(world: World) -> dict[str, dict]:
    """{problem key: {variant: (us, config)}} of this machine's online store in this mode (none if absent)."""
    from autofuse.measure import environment
    from autofuse.measure.store import Store, StoreError

    path = online_db(environment.fingerprint(world.device.type))
    if not path.is_file():
        return {}
    try:
        store = Store.open(path, readonly=True)
        try:
            rows = store.best(None, _mode(world))
        finally:
            store.close()
    except StoreError as exc:
        _warn_once(f"autofuse: online store unusable, ignored: {exc}")
        return {}
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["problem"], {})[r["variant"]] = (r["median_us"], r["config"])
    return out


def _confirm(world: World, op: Op, choice: Choice, args: tuple) -> Choice:
    """Measure BSP and the choice's candidates on `args` (every rank), keep the fastest, record it."""
    from autofuse.dispatch.confirm import confirm

    mode = _mode(world)
    bsp_config, _ = _policy(world).config_for(choice.problem, "bsp", op)
    result = confirm(world, op, choice.problem, args, choice.candidates, mode, bsp_config=bsp_config)
    stats.confirmations += 1
    if world.rank == 0:
        _record_online(world, op, choice.problem, result)
    entry = _confirmed.setdefault(world.device.type, {}).setdefault(choice.problem.key, {})
    for variant, config, us in result.timed:
        if us < entry.get(variant, (float("inf"),))[0]:
            entry[variant] = (us, config)
    stale = "stale: confirmed: " if choice.reason.startswith("stale:") else ""
    return Choice(op.name, choice.problem, result.variant, result.config,
                  f"{stale}{result.describe()}; the policy said: [{choice.basis}] {choice.reason}", "confirmed",
                  choice.policy_path, "measured on first use", confirmation=result)


def _record_online(world: World, op: Op, problem: Problem, result: Any) -> None:
    """Append the confirmation's measurements (source 'online') to this machine's online store."""
    from autofuse.measure import environment
    from autofuse.measure.timing import Measurement
    from autofuse.measure.store import Store, StoreError

    fp = environment.fingerprint(world.device.type)
    rows = [Measurement(problem, v, dict(c), result.mode, True, median_us=t.median_us, p10_us=t.p10_us,
                        p90_us=t.p90_us, min_us=t.min_us, reps=t.reps,
                        extra={"inner": t.inner, "sets": result.sets, "rounds": result.rounds})
            for (v, c, _), t in zip(result.timed, result.timings)]
    rows += [Measurement(problem, v, dict(c), result.mode, False, error=why) for v, c, why in result.dropped]
    try:
        path = online_db(fp)
        path.parent.mkdir(parents=True, exist_ok=True)
        with Store.open(path) as store:
            store.add(rows, fp, source="online")
    except (StoreError, OSError) as exc:
        _warn_once(f"autofuse: could not record confirmed measurements ({exc}); decisions still hold in this process")


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def agree_timeout_s(device_type: str) -> float:
    """How long a rank waits for the others to take part in an agreement: the flag-wait budget + 2 s,
    so a rank left alone fails within seconds of its peers' flag timeouts."""
    return status.wait_timeout_s(device_type) + 2.0


def _agree(world: World, op: str, choice: Choice | None, invalid: Exception | None) -> None:
    """Every rank publishes its validation outcome and choice; raise the same error on every rank if
    any rank's input was invalid or the choices differ. Bounded: uses the job's store with a timeout
    (a collective would block forever if a rank never comes), never NCCL."""
    if invalid is not None:
        mine = {"ok": False, "why": f"{type(invalid).__name__}: {invalid}"}
    else:
        cands = ";".join(f"{v}:{config_key(c)}" for v, c in choice.candidates)
        mine = {"ok": True, "hash": hashlib.sha256(
            f"{choice.problem.key}|{choice.variant}|{config_key(choice.config)}|{cands}".encode()).hexdigest()[:16],
            "said": f"{choice.variant} {config_key(choice.config)} for {choice.problem.key} "
                    f"([{choice.basis}] {choice.reason})"}
    every = _exchange(world, op, mine)
    bad = [(r, e["why"]) for r, e in enumerate(every) if not e["ok"]]
    if invalid is not None:
        raise invalid  # this rank's own reason; the others raise naming this rank
    if bad:
        lines = "\n".join(f"  rank {r}: {why}" for r, why in bad)
        raise InvalidInput(f"autofuse.{op}: invalid input on {len(bad)} of {world.size} ranks, so no rank ran it:\n"
                           f"{lines}")
    if len({e["hash"] for e in every}) > 1:
        lines = "\n".join(f"  rank {r}: {e['said']}" for r, e in enumerate(every))
        raise DispatchMismatch(
            f"autofuse.{op}: ranks disagree on what to run, so nothing was launched:\n{lines}\n"
            "Give every rank the same policy (AUTOFUSE_POLICY / models/), the same AUTOFUSE_VARIANT and "
            "variant=/config= arguments, and the same input shapes.")


def _exchange(world: World, op: str, mine: dict) -> list[dict]:
    """One JSON value per rank, in rank order, through the job's key-value store (bounded wait)."""
    if world.size == 1:
        return [mine]
    store = dist.distributed_c10d._get_default_store()
    group = (world.group if world.group is not None else dist.group.WORLD).group_name
    seq = _agreement_seq.get(group, 0)
    _agreement_seq[group] = seq + 1
    prefix = f"autofuse/agree/{group}/{seq}"
    keys = [f"{prefix}/{r}" for r in range(world.size)]
    store.set(keys[world.rank], json.dumps(mine))
    stats.agreements += 1
    timeout = agree_timeout_s(world.device.type)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - the store's timeout error type differs across torch versions
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise DispatchMismatch(
            f"autofuse.{op}: rank(s) {missing} did not take part in the first call of this problem within "
            f"{timeout:.0f} s ({type(exc).__name__}). A rank that ran a cached call with other shapes, skipped "
            "the call or died leaves the others here; its own kernels time out on their flags.") from None
    every = [json.loads(store.get(k)) for k in keys]
    if seq > 0:  # every rank has published this round, so all have read the previous one
        store.delete_key(f"autofuse/agree/{group}/{seq - 1}/{world.rank}")
    return every


def _check(entry: _Entry) -> None:
    runner = entry.runner
    if not getattr(runner, "workspaces", ()):
        return
    if runner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    stats.checks += 1
    runner.check()


def _capturing(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()


def _get_op(op: str | Op) -> Op:
    if not isinstance(op, str):
        return op
    if op not in _ops:
        from autofuse.core import registry

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
    """Where policies are searched, first match wins: AUTOFUSE_MODELS_DIR, this user's fitted policies
    (`autofuse fit`'s default output), models/ beside the package, the installed shipped ones."""
    from autofuse.dispatch.policy import user_models_dir

    here = Path(__file__).resolve().parents[1]  # the autofuse package
    dirs = [Path(p) for p in os.environ.get("AUTOFUSE_MODELS_DIR", "").split(os.pathsep) if p]
    dirs += [user_models_dir(), here.parent / "models", here / "models",
             Path(sys.prefix) / "share" / "autofuse" / "models"]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def find_policy(fingerprint: dict, mode: str | None = None) -> Path | None:
    """The first valid policy fitted on this hardware, or None. Preferred, in order: the timing
    `mode`, the same software (a policy from other software is used with every decision confirmed),
    earlier folders."""
    from autofuse.measure.environment import hardware_id, software_id
    from autofuse.dispatch.policy import read_file, validate

    found: list[tuple[bool, bool, int, str, Path]] = []
    for index, d in enumerate(models_dirs()):
        for path in sorted(d.glob("*.json")):
            data, _ = read_file(path)
            if data is None or validate(data) is not None:
                continue
            theirs = data["fingerprint"]
            if hardware_id(theirs) == fingerprint["hardware_id"]:
                found.append((data.get("mode") != mode, software_id(theirs) != fingerprint["software_id"], index,
                              str(path), path))
    return min(found)[-1] if found else None


def _policy(world: World) -> Any:
    kind = world.device.type
    if _forced_policy is not None:
        return _forced_policy
    if kind not in _policies:
        from autofuse.measure import environment
        from autofuse.dispatch.policy import Policy

        stats.policy_loads += 1
        fp = environment.fingerprint(kind)
        env = os.environ.get("AUTOFUSE_POLICY")
        path = Path(env) if env else find_policy(fp, _mode(world))
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
