"""Does a compiled kernel split a program around a barrier? A divergence check of Triton's LLVM IR.

A Triton program is a CTA of threads that must all reach every barrier (`bar.sync`, the barrier
inside an atomic's broadcast or a reduction, a wgmma, an mbarrier wait) the same number of times.
A branch on a value that differs between threads (a volatile load, a clock read, the thread id,
anything computed from them) makes threads take different paths; if a barrier lies on one of them,
the program deadlocks or pairs barriers wrongly. That is how fused gemm_rs kernels hung on GPUs
after a fault (docs/results/faults.md): the status word was read per thread. kernels/shmem.py now
makes every decision program-uniform; `divergent_barriers` checks the compiled kernels keep it so.

The analysis (standard divergence analysis on SSA form, as GPU compilers do it):
- per-thread sources: `%tid`, inline asm that reads `%globaltimer`, volatile/relaxed/acquire loads
  or atomics (a single thread's read before Triton's shared-memory broadcast is per-thread too);
- a value is per-thread if any operand is, except a load from shared memory: Triton moves values
  between threads only there (the broadcast of an atomic's result, the cross-warp step of a
  reduction, after a barrier), and a scalar that went through it is the program's. (A reduction
  that never leaves its warp, where warps hold copies of a vector, stays per-thread: warps may
  disagree.) An approximation: a per-thread value sent through shared memory and branched on
  without a reduction would be missed; Triton code cannot branch on a tensor element directly;
- a conditional branch on a per-thread value opens a divergent region: the blocks reachable from it
  before its immediate post-dominator (where the threads meet again). Phis where paths meet and
  values defined in the region but used after it are per-thread (threads leave a loop in different
  rounds);
- a barrier or warp-collective instruction inside a divergent region is reported.
"""
from __future__ import annotations

import re

_VALUE = re.compile(r"%[\w.$-]+")
_PER_THREAD_ASM = re.compile(r"%globaltimer|ld\.volatile|ld\.global\.sys|ld\.global\.acquire|ld\.global\.relaxed|"
                             r"ld\.acquire|ld\.relaxed|\batom\.")
_COLLECTIVE = re.compile(r"@llvm\.nvvm\.(barrier|bar\.|shfl\.sync|vote|redux|wgmma|cp\.async\.bulk\.wait)|"
                         r"asm[^\"]*\"[^\"]*(bar\.sync|barrier\.sync|bar\.arrive|wgmma|mbarrier|\.aligned|shfl\.sync)")


class _Block:
    def __init__(self, name: str):
        self.name = name
        self.lines: list[str] = []
        self.succ: list[str] = []
        self.cond: str | None = None  # the condition value of a conditional branch at the end


def _function(llir: str) -> list[_Block]:
    """The basic blocks of the module's first function (the kernel), debug metadata dropped."""
    body = llir[llir.index("define "):].partition("{\n")[2]
    body = body[:body.index("\n}\n")]
    blocks = [_Block("%entry")]
    in_switch = False
    for raw in body.splitlines():
        m = re.match(r"^([\w.$-]+):", raw)
        if m:
            blocks.append(_Block("%" + m.group(1)))
            continue
        line = re.sub(r", ![\w.]+ !\d+", "", raw.strip())
        if not line or line.startswith(";"):
            continue
        blk = blocks[-1]
        blk.lines.append(line)
        if in_switch or line.startswith(("br ", "switch ")):
            blk.succ += re.findall(r"label (%[\w.$-]+)", line)
            m = re.match(r"br i1 (%[\w.$-]+),", line)
            blk.cond = m.group(1) if m else blk.cond
            if line.startswith("switch "):
                blk.cond = _VALUE.findall(line)[0]
            in_switch = (in_switch or line.startswith("switch ")) and not line.endswith("]")
    return blocks


def _postdominators(blocks: list[_Block]) -> dict[str, set[str]]:
    names = [b.name for b in blocks] + ["EXIT"]
    succ = {b.name: (b.succ or ["EXIT"]) for b in blocks}
    pdom = {n: set(names) for n in names}
    pdom["EXIT"] = {"EXIT"}
    changed = True
    while changed:
        changed = False
        for b in reversed(blocks):
            new = {b.name} | set.intersection(*(pdom[s] for s in succ[b.name]))
            if new != pdom[b.name]:
                pdom[b.name] = new
                changed = True
    return pdom


def _ipdom(name: str, pdom: dict[str, set[str]]) -> str:
    strict = pdom[name] - {name}
    return max(strict, key=lambda n: len(pdom[n]))  # the closest post-dominator has the most of its own


def _region(block: _Block, stop: str, by_name: dict[str, _Block]) -> set[str]:
    seen: set[str] = set()
    todo = [s for s in block.succ if s != stop]
    while todo:
        n = todo.pop()
        if n in seen or n == stop or n not in by_name:
            continue
        seen.add(n)
        todo += by_name[n].succ
    return seen


def _defines(line: str) -> str | None:
    m = re.match(r"^(%[\w.$-]+) = ", line)
    return m.group(1) if m else None


def divergent_barriers(llir: str) -> list[str]:
    """Barriers and warp-collectives that some threads of a program may skip or repeat: one line each
    ('<block>: <instruction>'), empty when every branch around them is program-uniform."""
    blocks = _function(llir)
    by_name = {b.name: b for b in blocks}
    pdom = _postdominators(blocks)
    where = {}  # value -> block defining it
    for b in blocks:
        for line in b.lines:
            v = _defines(line)
            if v:
                where[v] = b.name
    per_thread: set[str] = set()
    reports: dict[str, str] = {}
    changed = True
    while changed:
        changed = False

        def taint(value: str | None) -> None:
            nonlocal changed
            if value and value not in per_thread:
                per_thread.add(value)
                changed = True

        for b in blocks:
            for line in b.lines:
                v = _defines(line)
                if not v or v in per_thread:
                    continue
                rhs = line.split(" = ", 1)[1]
                if "@llvm.nvvm.read.ptx.sreg.tid" in rhs or "@llvm.nvvm.read.ptx.sreg.laneid" in rhs:
                    taint(v)
                elif "asm" in rhs and _PER_THREAD_ASM.search(rhs):
                    taint(v)
                elif re.match(r"(tail )?call .*@llvm\.nvvm\.atomic", rhs) or rhs.startswith(("atomicrmw", "cmpxchg")):
                    taint(v)
                elif (rhs.startswith("load ") and "addrspace(3)" in rhs) or ("asm" in rhs and "ld.shared" in rhs):
                    continue  # shared memory after a barrier: where Triton makes a value the program's
                elif set(_VALUE.findall(rhs)) & per_thread:
                    taint(v)
        for b in blocks:
            if b.cond is None or b.cond not in per_thread:
                continue
            meet = _ipdom(b.name, pdom)
            region = _region(b, meet, by_name)
            for n in region:
                for line in by_name[n].lines:
                    if _COLLECTIVE.search(line):
                        reports.setdefault(f"{n}: {line[:160]}", b.name)
                    v = _defines(line)
                    if v and line.split(" = ", 1)[1].startswith("phi "):
                        taint(v)
            if meet in by_name:
                for line in by_name[meet].lines:
                    v = _defines(line)
                    if v and line.split(" = ", 1)[1].startswith("phi "):
                        taint(v)
            inside = {v for v, blk in where.items() if blk in region}
            for other in blocks:
                if other.name in region:
                    continue
                for line in other.lines:
                    used = set(_VALUE.findall(line.split(" = ", 1)[-1])) & inside
                    for v in used:
                        taint(v)
    return sorted(reports)
