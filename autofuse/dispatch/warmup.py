"""Warm-up for serving: every first-call cost of a model's shapes paid ahead of time, not by a request.

A problem's first call in a process decides (policy, or an earlier confirmation), agrees with every
rank, confirms a predicted decision by timing the candidates (GPUs: up to seconds per problem, with
Triton compiling each candidate), builds the runner (heap workspaces) and checks the first result.
`warmup_problems(problems, group)` makes those first calls for a list of problems, on every rank in
lockstep (each rank calls it alike, in the same order), on random inputs of the problems' shapes;
`autofuse.warmup(model, group, tokens=[...])` (autofuse/nn/warmup.py: models live a floor above
dispatch) derives them from a parallelized model's layers and reports through `first_calls`.

What later processes keep (so that their first request of a warmed shape neither confirms nor
compiles): confirmations go to the online store (`online.online_db`, AUTOFUSE_ONLINE_DB), which a
new process reads before asking the policy (basis `confirmed`, nothing timed); Triton keeps every
kernel it compiled (every candidate's) in its on-disk cache (TRITON_CACHE_DIR, default
~/.triton/cache). Heap workspaces, the agreement and this process's dictionary of runners are per
process: the same process serving after `warmup` pays nothing more; a new one pays the agreement
and the workspace build on its first call (milliseconds), never a confirmation or a compile.

Where confirmation is off (the CPU emulation by default, AUTOFUSE_ONLINE=0, ranks sharing a GPU)
warmup confirms nothing either: a decision is then the policy's, made again by every process
without timing (nothing to persist), and warmup decides, builds and runs each problem once. It
never turns confirmation on by itself: the interpreter's timings would then be stored as
measurements that later processes trust. Set AUTOFUSE_ONLINE=1 to confirm (and persist) on CPU.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import torch

from autofuse.core import settings
from autofuse.core.op import Op, Problem
from autofuse.dispatch.state import STATE, op_of, world_of


@dataclass
class Warmed:
    """One problem's first call: its decision, whether it was confirmed now, and what it cost here.

    `state`: 'new' (this process's first call of it), 'cached' (already decided in this process).
    `confirmed_now`: a confirmation timed candidates during this call (recorded for later processes).
    """

    problem: str
    variant: str
    basis: str
    state: str
    confirmed_now: bool
    seconds: float
    reason: str = ""


@dataclass
class WarmupReport:
    """What `warmup`/`warmup_problems` did on this rank: per problem, in call order; totals."""

    problems: list[Warmed] = field(default_factory=list)
    seconds: float = 0.0
    confirmation: bool = False  # whether dispatch confirms predictions here (settings.online)
    online_db: str = ""

    @property
    def confirmations(self) -> int:
        return sum(w.confirmed_now for w in self.problems)

    @property
    def decisions(self) -> dict[str, int]:
        """{basis: count} over the problems decided now."""
        out: dict[str, int] = {}
        for w in self.problems:
            if w.state == "new":
                out[w.basis] = out.get(w.basis, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"problems": [asdict(w) for w in self.problems], "seconds": self.seconds,
                "confirmation": self.confirmation, "confirmations": self.confirmations,
                "decisions": self.decisions, "online_db": self.online_db}

    def __str__(self) -> str:
        new = sum(w.state == "new" for w in self.problems)
        head = (f"warmed {len(self.problems)} problems ({new} new) in {self.seconds:.2f} s: "
                f"{self.confirmations} confirmed now")
        head += (f", recorded in {self.online_db}" if self.confirmation else
                 " (confirmation is off here: decisions are the policy's, made again without timing by every process)")
        lines = [head] + [f"  {w.problem}: {w.variant} [{w.basis}] {w.state}, {w.seconds * 1e3:.0f} ms"
                          + (" (confirmed now)" if w.confirmed_now else "") for w in self.problems]
        return "\n".join(lines)


def first_calls(world: Any, calls: Iterable[tuple[str, Any]], report: WarmupReport) -> WarmupReport:
    """Run each `(label, thunk)` (a thunk making dispatched calls on `world`'s ranks) and record, per
    problem the cache gained, its decision and cost; then wait for every rank."""
    t_all = time.perf_counter()
    for label, thunk in calls:
        before, confirmations = set(STATE.cache), STATE.stats.confirmations
        t0 = time.perf_counter()
        thunk()
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        seconds = time.perf_counter() - t0
        new = [STATE.cache[k].choice for k in STATE.cache.keys() - before]
        confirmed_now = STATE.stats.confirmations > confirmations
        if not new:
            report.problems.append(Warmed(label, "", "", "cached", False, seconds))
        for c in new:
            report.problems.append(Warmed(c.problem.key, c.variant, c.basis, "new", confirmed_now, seconds, c.reason))
    world.sync()
    report.seconds = time.perf_counter() - t_all
    return report


def new_report(world: Any) -> WarmupReport:
    """An empty report saying whether dispatch confirms here and where confirmations go."""
    from autofuse.dispatch.online import online_db
    from autofuse.measure import environment

    on = settings.online(world.device.type, world.shares_gpu)
    db = str(online_db(environment.fingerprint(world.device.type))) if on else ""
    return WarmupReport(confirmation=on, online_db=db)


def _problem(item: Problem | str) -> Problem:
    if isinstance(item, Problem):
        return item
    if isinstance(item, str):
        return Problem.from_key(item)
    raise TypeError(f"warmup_problems takes Problems or problem keys, got {type(item).__name__}")


def warmup_problems(problems: Iterable[Problem | str], group: Any = None, *, ops: Sequence[Op] = (),
                    seed: int = 0) -> WarmupReport:
    """Make each problem's first call on every rank of `group` (collective: every rank calls it with
    the same problems in the same order), on random inputs of its shapes: decision, agreement,
    confirmation where dispatch confirms, compile, workspace build. `problems`: Problems or problem
    keys ('gemm_ar|K=14336,M=8,N=4096|bfloat16|w2'), for `group`'s size; `ops`: Op objects for
    problems of ops outside the registry. Returns this rank's report."""
    world = world_of(group)
    known = {op.name: op for op in ops}
    todo = [_problem(p) for p in problems]
    for p in todo:
        if p.world != world.size:
            raise ValueError(f"warmup: {p.key} is for {p.world} ranks, the group has {world.size}")

    def calls() -> Iterable[tuple[str, Any]]:
        from autofuse.dispatch.entry import call

        for p in todo:
            op = known.get(p.op) or op_of(p.op)
            args = op.inputs(world, p, seed)
            got = op.problem_of(world, *args)
            if got.key != p.key:
                raise ValueError(f"warmup: {p.key} is not a complete {p.op} problem (its inputs make {got.key})")
            yield p.key, lambda op=op, args=args: call(op, *args, group=group)

    return first_calls(world, calls(), new_report(world))


def token_dim(op: str) -> str:
    """The dim a token count sets in `op`'s problems: the rows M of the GEMM ops, the batch B of flash_decode."""
    return "B" if op == "flash_decode" else "M"


def preset_problems(model: str, world: int, tokens: Sequence[int], sequence_parallel: bool = False,
                    dtype: str = "bfloat16") -> list[Problem]:
    """The op problems of one decoder layer of a model preset (`autofuse.core.shapes.MODELS`, e.g.
    llama3-8b, llama3-70b) at each token count, tensor-parallel over `world` ranks, in layer order:
    without sequence parallelism the row-parallel o/down projections (gemm_ar; the column-parallel
    ones are local GEMMs), with it qkv and gate/up (ag_gemm, rows rounded up to a multiple of
    `world`) and o/down (gemm_rs)."""
    from autofuse.core.shapes import MODELS, layer_gemms

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: known models are {', '.join(MODELS)}")
    out: list[Problem] = []
    for t in tokens:
        rows = -(-int(t) // world) * world if sequence_parallel else int(t)
        for g in layer_gemms(MODELS[model], world):
            if g.kind == "column" and sequence_parallel:
                out.append(Problem.make("ag_gemm", dtype, world, M=rows, N=g.N, K=g.K, gather="rows"))
            elif g.kind == "row":
                out.append(Problem.make("gemm_rs" if sequence_parallel else "gemm_ar", dtype, world, M=rows, N=g.N,
                                        K=g.K))
    return list(dict.fromkeys(out))
