"""Heap collectives (autofuse.comm.collectives, kernels/collectives.py) on CPU ranks against float64 references.

One case table, used by the CPU tests (2 and 4 ranks; the Triton interpreter, the shm heap) and by the
GPU test (GPU sizes, CUDA-graph replay). The collectives are wrapped in a small test op (`OP`) so that
tests/harness.py runs them like any op: repeated calls, interleaved calls of every case (all built with
the default workspace name, so they share one epoch and one set of flags), fault scenarios.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

import harness
from autofuse.comm import collectives as C
from autofuse.comm import status
from autofuse.core.op import InvalidConfig, InvalidInput, Op, Problem, Variant, default_tolerance, rel_error
from autofuse.core.runner import Runner, TensorSpec
from autofuse.comm.workspace import workspaces
from autofuse.comm.world import spawn
from conftest import CTX, assert_uniform, compile_request, compile_sm90_many

BF, HALF, F32 = "bfloat16", "float16", "float32"


# -- the collectives as a test op ---------------------------------------------------------------------
class _CollRunner(Runner):
    def __init__(self, world, problem: Problem, coll):
        super().__init__(world, problem, [TensorSpec("x", coll.in_shape, problem.torch_dtype)],
                         TensorSpec("out", coll.out_shape, problem.torch_dtype), workspaces=coll.workspaces)
        self.coll = coll

    def launch(self, x, out):
        self.coll(x, out=out)


class _CollVariant(Variant):
    """Variant named after the collective kind; its config is the collective's."""

    family = "hybrid"

    def check(self, problem, config):
        return C.check(self.name, problem.world, problem["rows"], problem["cols"], problem.torch_dtype, config,
                       problem["dim"])

    def runner(self, world, problem, config):
        coll = C.build(self.name, world, problem["rows"], problem["cols"], problem.torch_dtype, config, problem["dim"])
        return _CollRunner(world, problem, coll)


def _shard(problem: Problem, seed: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(problem["rows"], problem["cols"], generator=g).to(problem.torch_dtype).to(device)


def _inputs(world, problem, seed):
    return (_shard(problem, seed, world.rank, world.device),)


def _reference(world, problem, seed):
    shards = [_shard(problem, seed, q, world.device) for q in range(problem.world)]
    return C.reference(problem.op, shards, world.rank, problem["dim"])


def _tolerance(problem):
    # the gather is exact; the sums are float32 sums of W values rounded once to the dtype
    return 0.0 if problem.op == "all_gather" else default_tolerance(problem.dtype, problem.world)


def _op(kind: str) -> Op:
    return Op(name=kind, args=("x",), variants=[_CollVariant(kind)], problem_of=None, inputs=_inputs,
              reference=_reference, tolerance=_tolerance, features=lambda p: {}, sweep=lambda kind, w: [])


OPS = {kind: _op(kind) for kind in C.KINDS}


gpu_test = harness.gpu


def _dims(rows, cols, dim=0):
    return {"rows": rows, "cols": cols, "dim": dim}


# (kind, dims, dtype, config); rows of a reduce-scatter are per-rank rows times WORLD (filled in below)
SMALL = {"COMM_SMS": 2, "BLOCK": 1024, "num_warps": 4}
CASES = [
    ("all_gather", _dims(3, 40), BF, {"ALGO": "inbox", **SMALL}),
    ("all_gather", _dims(3, 40), HALF, {"ALGO": "push", **SMALL}),
    ("all_gather", _dims(5, 37), BF, {"ALGO": "pull", **SMALL}),
    ("all_gather", _dims(4, 24), F32, {"ENGINE": "ce", "COMM_SMS": 1}),
    ("all_gather", _dims(5, 24, 1), F32, {"ALGO": "push", **SMALL}),
    ("all_gather", _dims(6, 16, 1), BF, {"ALGO": "inbox", **SMALL, "CHUNKS": 2}),
    ("all_gather", _dims(2, 520), BF, {"ALGO": "inbox", "COMM_SMS": 4, "BLOCK": 1024, "num_warps": 4, "CHUNKS": 2}),
    ("reduce_scatter", _dims("2W", 40), BF, SMALL),
    ("reduce_scatter", _dims("1W", 33), HALF, {**SMALL, "CHUNKS": 2}),
    ("reduce_scatter", _dims("2W", 24), F32, {"ENGINE": "ce", "COMM_SMS": 1}),
    ("all_reduce", _dims(5, 40), BF, {"ALGO": "one_shot", **SMALL}),
    ("all_reduce", _dims(5, 40), BF, {"ALGO": "two_shot", **SMALL}),
    ("all_reduce", _dims(3, 24), HALF, {"ALGO": "one_shot", "ENGINE": "ce", "COMM_SMS": 1}),
    ("all_reduce", _dims(9, 40), F32, {"ALGO": "two_shot", **SMALL, "CHUNKS": 2}),
    ("all_reduce", _dims(6, 24), BF, {"ALGO": "one_shot", **SMALL, "CHUNKS": 3}),
]
FOUR_RANKS = [0, 1, 2, 4, 7, 8, 11, 13]  # indices of CASES also run at 4 ranks


def _concrete(case, world_size):
    kind, dims, dtype, config = case
    dims = dict(dims)
    if isinstance(dims["rows"], str):
        dims["rows"] = int(dims["rows"][:-1]) * world_size
    return kind, dims, dtype, config


def _run_table(world, cases):
    """Every case through the harness; returns per-case rows (name, err, tol, checksum) in table order."""
    by_kind: dict[str, list] = {}
    for kind, dims, dtype, config in cases:
        by_kind.setdefault(kind, []).append((kind, dims, dtype, config))
    results = []
    for kind, items in by_kind.items():
        results += harness.run_cases(world, OPS[kind], items, calls=2)
    results += _interleaved(world, cases)
    return results


def _interleaved(world, cases):
    """Calls alternating across collectives of different kinds on one workspace (the harness interleaves
    within one op only): one round of every case, twice."""
    built = []
    for kind, dims, dtype, config in cases:
        problem = harness.problem_of(OPS[kind], world.size, dims, dtype)
        built.append((kind, problem, OPS[kind].variant(kind).build(world, problem, config)))
    worst = [0.0] * len(built)
    last = [0] * len(built)
    for seed in (300, 301):
        for i, (kind, problem, runner) in enumerate(built):
            op = OPS[kind]
            out = runner(*op.inputs(world, problem, seed))
            runner.check()
            ref = op.reference(world, problem, seed)
            worst[i] = max(worst[i], rel_error(out, ref))
            last[i] = harness._checksum(out)
    return [(f"interleaved {kind} {problem.key}", worst[i], _tolerance(problem), last[i])
            for i, (kind, problem, _) in enumerate(built)]


def _cpu_job(world, indices):
    return _run_table(world, [_concrete(CASES[i], world.size) for i in indices])


def test_two_ranks_every_algorithm_engine_dtype_and_odd_shapes():
    results = spawn(_cpu_job, 2, list(range(len(CASES))), device_kind="cpu", timeout_s=900)
    harness.assert_ok(results, same_bits=("all_reduce", "interleaved all_reduce"))


def test_four_ranks():
    results = spawn(_cpu_job, 4, FOUR_RANKS, device_kind="cpu", timeout_s=900)
    harness.assert_ok(results, same_bits=("all_reduce", "interleaved all_reduce"))


def test_one_rank_every_algorithm():
    results = spawn(_cpu_job, 1, [0, 1, 2, 3, 4, 7, 9, 10, 11, 12], device_kind="cpu", timeout_s=600)
    harness.assert_ok(results)


def _one_and_two_shot_bits(world):
    rows = []
    for algo in C.AR_ALGOS:
        coll = C.all_reduce(world, 7, 48, torch.bfloat16, {"ALGO": algo, **SMALL})
        x = _shard(harness.problem_of(OPS["all_reduce"], world.size, _dims(7, 48), BF), 5, world.rank, world.device)
        rows.append(harness._checksum(coll(x)))
        coll.check()
    return rows


def test_all_reduce_one_and_two_shot_agree_bitwise_on_every_rank():
    results = spawn(_one_and_two_shot_bits, 2, device_kind="cpu", timeout_s=300)
    assert len({v for r in results for v in r}) == 1, results


# -- the overlap interface: start + per-chunk waits, chunked reduce-scatter pushes ----------------------
def _overlap_job(world):
    torch.manual_seed(0)
    out = []
    w, r = world.size, world.rank
    for dim in (0, 1):
        ag = C.all_gather(world, 6, 32, torch.bfloat16, {"ALGO": "push", **SMALL, "CHUNKS": 3}, dim=dim)
        plain = C.all_gather(world, 6, 32, torch.bfloat16, {"ALGO": "inbox", **SMALL}, dim=dim)
        for seed in range(3):
            xs = [torch.randn(6, 32, generator=torch.Generator().manual_seed(seed * 10 + q)).bfloat16()
                  for q in range(w)]
            buf = ag.start(xs[r])
            order = []
            for i, c in enumerate(ag.chunks):
                ag.wait(i)
                order.append((c.owner, c.index))
            ag.check()
            ok = torch.equal(buf.double(), C.reference("all_gather", xs, r, dim))
            got = plain(xs[r])  # a non-overlapped call on the same workspace between overlapped ones
            ok = ok and torch.equal(got.double(), C.reference("all_gather", xs, r, dim))
            out.append((dim, seed, ok, len(ag.chunks), order))
    rs = C.reduce_scatter(world, 4 * w, 40, torch.float32, {**SMALL, "CHUNKS": 2})
    for seed in range(2):
        xs = [torch.randn(4 * w, 40, generator=torch.Generator().manual_seed(seed * 10 + q)) for q in range(w)]
        res = torch.full((4, 40), math.nan)
        for i, c in enumerate(rs.chunks):
            rs.push(xs[r], i)
        rs.reduce(xs[r], res)
        rs.check()
        err = (res.double() - C.reference("reduce_scatter", xs, r)).abs().max().item()
        out.append(("rs", seed, err < 1e-5, len(rs.chunks), [(c.owner, c.index) for c in rs.chunks]))
    return out


def test_overlap_start_waits_and_chunked_pushes():
    results = spawn(_overlap_job, 2, device_kind="cpu", timeout_s=600)
    for rank, rows in enumerate(results):
        for row in rows:
            assert row[2], f"rank {rank}: {row}"
        ag_rows = [row for row in rows if row[0] in (0, 1)]
        assert all(row[3] == 3 for row in ag_rows)  # 3 chunks of the one peer
        assert ag_rows[0][4] == [(1 - rank, 0), (1 - rank, 1), (1 - rank, 2)]
        rs_rows = [row for row in rows if row[0] == "rs"]
        assert rs_rows[0][4] == [(1 - rank, 0), (1 - rank, 1), (rank, 0), (rank, 1)]  # peers' rows first


# -- faults -------------------------------------------------------------------------------------------
FAULT_CASES = [  # (kind, dims, dtype, config, scenarios)
    ("all_gather", _dims(3, 40), BF, {"ALGO": "inbox", **SMALL}, ("late_peer", "skipped_call", "dead_peer")),
    ("all_gather", _dims(3, 40), BF, {"ALGO": "push", **SMALL}, ("late_peer", "skipped_call")),
    ("all_gather", _dims(3, 40), BF, {"ALGO": "pull", **SMALL}, ("skipped_call",)),
    ("all_gather", _dims(3, 40), BF, {"ENGINE": "ce", "COMM_SMS": 1}, ("late_peer", "skipped_call")),
    ("reduce_scatter", _dims("2W", 40), BF, SMALL, ("late_peer", "skipped_call", "dead_peer")),
    ("reduce_scatter", _dims("2W", 40), BF, {"ENGINE": "ce", "COMM_SMS": 1}, ("skipped_call",)),
    ("all_reduce", _dims(4, 40), BF, {"ALGO": "one_shot", **SMALL}, ("late_peer", "skipped_call")),
    ("all_reduce", _dims(4, 40), BF, {"ALGO": "two_shot", **SMALL}, ("skipped_call", "dead_peer")),
]


def _rebuild_all(world):
    world.sync()
    for ws in workspaces(world):
        ws.rebuild()


def _fault_job(world, plan):
    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)  # before any workspace exists
    seen = []
    for kind, dims, dtype, config, scenario in plan:
        seen.append(harness.fault_run(world, OPS[kind], kind, dims, dtype, config, scenario, calls=3))
        _rebuild_all(world)
    return seen


def _fault_plan(world_size, cases):
    return [(*_concrete((k, d, t, c), world_size), s) for k, d, t, c, scenarios in cases for s in scenarios]


@pytest.mark.parametrize("part", [0, 1])
def test_faults_raise_on_every_rank_and_never_return_wrong_results(part):
    cases = FAULT_CASES[:4] if part == 0 else FAULT_CASES[4:]
    plan = _fault_plan(2, cases)
    results = spawn(_fault_job, 2, plan, device_kind="cpu", timeout_s=900)
    for i in range(len(plan)):
        harness.check_fault_run([r[i] for r in results])


def test_dead_peer_at_four_ranks_and_two_sizes():
    """The time to fail is the wait budget whatever the size (each wait polls the abort word)."""
    cases = [("all_gather", _dims(2, 64), BF, {"ALGO": "inbox", **SMALL}, ("dead_peer",)),
             ("all_gather", _dims(16, 64), BF, {"ALGO": "inbox", **SMALL}, ("dead_peer",))]
    plan = _fault_plan(4, cases)
    results = spawn(_fault_job, 4, plan, device_kind="cpu", timeout_s=900)
    for i in range(len(plan)):
        harness.check_fault_run([r[i] for r in results])


# -- configs (no ranks) --------------------------------------------------------------------------------
class _Trial:
    """The part of optuna.Trial a search space uses, drawing at random (fixed seed)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.params = {}

    def suggest_categorical(self, name, choices):
        self.params[name] = self.rng.choice(list(choices))
        return self.params[name]

    def suggest_int(self, name, low, high, step=1, log=False):
        self.params[name] = self.rng.randrange(low, high + 1, step)
        return self.params[name]


SHAPES = [("all_gather", 4, 8192, 0), ("all_gather", 8192, 4096, 1), ("all_gather", 4096, 8192, 0),
          ("reduce_scatter", 64, 8192, 0), ("reduce_scatter", 8192, 8192, 0), ("all_reduce", 8, 8192, 0),
          ("all_reduce", 4096, 8192, 0)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_defaults_and_sampled_spaces_pass_their_checks(world):
    for kind, rows, cols, dim in SHAPES:
        rows = rows * world if kind == "reduce_scatter" else rows
        defs = C.defaults(kind, world, rows, cols, torch.bfloat16, dim)
        assert defs, (kind, rows, cols)
        for cfg in defs:
            assert C.check(kind, world, rows, cols, torch.bfloat16, cfg, dim) is None, (kind, cfg)
        for seed in range(30):
            cfg = C.space(kind, _Trial(seed), world, rows, cols, torch.bfloat16, dim)
            assert C.check(kind, world, rows, cols, torch.bfloat16, cfg, dim) is None, (kind, cfg)
    small = C.defaults("all_gather", 2, 4, 8192, torch.bfloat16)[0]
    large = C.defaults("all_gather", 2, 4096, 8192, torch.bfloat16)
    assert small["ALGO"] == "inbox" and small["COMM_SMS"] <= 8  # latency: few programs, one hop
    assert large[0]["COMM_SMS"] == 64 and any(c["ENGINE"] == "ce" for c in large)  # bandwidth


@pytest.mark.parametrize("kind,rows,cols,config,dim,needle", [
    ("all_gather", 4, 64, {"ALGO": "ring"}, 0, "ALGO must be one of"),
    ("all_gather", 4, 64, {"ENGINE": "ce"}, 1, "copy engine does not run all_gather along columns"),
    ("all_gather", 4, 64, {"ENGINE": "ce", "ALGO": "pull"}, 0, "ALGO must be push"),
    ("all_gather", 4, 64, {"COMM_SMS": 3}, 0, "COMM_SMS must be one of"),
    ("all_gather", 4, 64, {"CHUNKS": 9}, 0, "CHUNKS must be an integer"),
    ("all_gather", 4, 64, {"FLAG": "tile"}, 0, "unknown config keys ['FLAG']"),
    ("all_gather", 4, 64, {}, 2, "dim must be 0 or 1"),
    ("reduce_scatter", 5, 64, {}, 0, "divisible by the world size"),
    ("all_reduce", 4, 64, {"ALGO": "two_shot", "ENGINE": "ce"}, 0, "does not run two_shot"),
    ("all_reduce", 4, 64, {"BLOCK": 100}, 0, "BLOCK must be one of"),
    ("broadcast", 4, 64, {}, 0, "unknown collective"),
])
def test_check_gives_reasons(kind, rows, cols, config, dim, needle):
    why = C.check(kind, 2, rows, cols, torch.bfloat16, config, dim)
    assert why is not None and needle in why, why


def test_resolve_fills_defaults_and_rejects_bad_configs():
    cfg = C.resolve("all_gather", 2, 4, 8192, torch.bfloat16, {"ALGO": "pull"})
    assert cfg["ALGO"] == "pull" and cfg["CHUNKS"] == 1 and cfg["ENGINE"] == "sm" and "COMM_SMS" in cfg
    ce = C.resolve("all_gather", 2, 4, 8192, torch.bfloat16, {"ENGINE": "ce"})
    assert ce["ALGO"] == "push" and ce["COMM_SMS"] == 1
    with pytest.raises(InvalidConfig, match="num_warps"):
        C.resolve("all_reduce", 2, 4, 64, torch.bfloat16, {"num_warps": 3})


def _bad_inputs(world):
    coll = C.all_gather(world, 3, 40, torch.bfloat16, SMALL)
    errors = []
    bf = torch.bfloat16
    for x in (torch.zeros(3, 41, dtype=bf), torch.zeros(3, 40), torch.zeros(40, 3, dtype=bf).t()):
        try:
            coll(x)
        except InvalidInput as exc:
            errors.append(str(exc))
    try:
        C.all_gather(world, 3, 40, torch.int32)
    except InvalidInput as exc:
        errors.append(str(exc))
    good = coll(torch.ones(3, 40, dtype=torch.bfloat16))
    coll.check()
    return errors, bool((good == 1).all())


def test_bad_inputs_are_refused_before_launch_and_the_next_call_works():
    for errors, ok in spawn(_bad_inputs, 2, device_kind="cpu", timeout_s=300):
        assert len(errors) == 4, errors
        assert "must be a contiguous (3, 40)" in errors[0] and "not contiguous" in errors[2]
        assert "not supported" in errors[3]
        assert ok


# -- sm_90 compiles ------------------------------------------------------------------------------------
MOD = "autofuse.kernels.collectives"
AG_SIG = {"x": "*bf16", "out": "*bf16", "buf": "*bf16", "ctx": CTX, "flags": "*i32", "half_flags": "i32",
          "data_half": "i32", "rows": "i32", "width": "i32", "dst_ld": "i32", "src_step": "i32", "chunks": "i32",
          "chunk_rows": "i32", "piece_rows": "i32", "ALGO": "constexpr", "WAITED": "constexpr",
          "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
AG_DIV = ["x", "out", "buf", "flags", "half_flags", "data_half", "width", "dst_ld", "src_step"]
RD_SIG = {"x": "*bf16", "out": "*bf16", "buf": "*bf16", "ctx": CTX, "flags": "*i32", "half_flags": "i32",
          "data_half": "i32", "owner_rows": "i32", "total_rows": "i32", "width": "i32", "chunks": "i32",
          "chunk_rows": "i32", "piece_rows": "i32", "only_owner": "i32", "only_chunk": "i32", "box2": "i32",
          "MODE": "constexpr", "SEND": "constexpr", "REDUCE": "constexpr", "FIXED": "constexpr",
          "PUBLISH": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
RD_DIV = ["x", "out", "buf", "flags", "half_flags", "data_half", "width", "box2"]
WAIT_SIG = {"ctx": CTX, "flags": "*i32", "half_flags": "i32", "out": "*bf16", "src": "i32", "chunk": "i32",
            "lo": "i32", "hi": "i32", "width": "i32", "dst_ld": "i32", "src_step": "i32", "chunks": "i32",
            "programs": "i32", "LAST": "constexpr", "WAIT_BLOCK": "constexpr", "BLOCK_R": "constexpr",
            "BLOCK_C": "constexpr"}
TILE = {"BLOCK_R": 4, "BLOCK_C": 1024}


def _sm90_requests():
    reqs = []
    for algo in range(5):
        for waited in (False, True):
            reqs.append(compile_request(MOD, "all_gather_kernel", AG_SIG, {"ALGO": algo, "WAITED": waited, **TILE},
                                        num_warps=8, num_stages=1, divisible=AG_DIV, name=f"ag{algo}{int(waited)}"))
    for name, consts in {"rs": dict(MODE=0, SEND=1, REDUCE=True, FIXED=False, PUBLISH=True),
                         "rs_push": dict(MODE=0, SEND=1, REDUCE=False, FIXED=False, PUBLISH=False),
                         "rs_reduce": dict(MODE=0, SEND=0, REDUCE=True, FIXED=False, PUBLISH=True),
                         "rs_ce": dict(MODE=0, SEND=2, REDUCE=True, FIXED=True, PUBLISH=True),
                         "ar1": dict(MODE=1, SEND=1, REDUCE=True, FIXED=False, PUBLISH=True),
                         "ar2": dict(MODE=2, SEND=1, REDUCE=True, FIXED=False, PUBLISH=True)}.items():
        reqs.append(compile_request(MOD, "reduce_kernel", RD_SIG, {**consts, **TILE}, num_warps=8, num_stages=1,
                                    divisible=RD_DIV, name=name))
    reqs.append(compile_request(MOD, "chunk_wait_kernel", WAIT_SIG, {"LAST": True, "WAIT_BLOCK": 64, **TILE},
                                num_warps=4, num_stages=1, divisible=["out", "flags", "width", "dst_ld"], name="wait"))
    return reqs


def test_kernels_compile_for_sm90_with_vector_accesses_sys_release_and_bounded_waits():
    kernels = compile_sm90_many(_sm90_requests())
    for name, k in kernels.items():
        assert_uniform(k, name)  # every wait's decision is the program's (no barrier in a per-thread branch)
    ptx = {name: v["ptx"] for name, v in kernels.items()}
    movers = ["ag00", "ag10", "ag20", "rs", "rs_push", "ar1", "ar2"]
    for name in movers:  # 16-byte vector stores of the data (rows of 1024 elements, aligned)
        assert "st.global.v4" in ptx[name], name
    for name in ["ag00", "ag10", "ag20", "ag30", "ag40", "rs", "rs_ce", "ar1", "ar2", "wait"]:
        assert "ld.volatile.global" in ptx[name] and "%globaltimer" in ptx[name], name  # bounded exact waits
    for name in ["ag00", "ag10", "ag20", "ag40", "rs", "rs_push", "ar1", "ar2"]:
        assert "atom.global.sys.release.exch.b32" in ptx[name], name  # flags released at system scope
    assert "st.global.v4" not in ptx["ag30"]  # the copy engine's ready kernel moves no data
    assert "%globaltimer" not in ptx["rs_push"]  # a push launch never waits


# -- GPU ----------------------------------------------------------------------------------------------
GPU_SMALL = {"COMM_SMS": 8, "BLOCK": 4096, "num_warps": 8}
GPU_CASES = [
    ("all_gather", _dims(4, 8192), BF, {"ALGO": a, **GPU_SMALL}) for a in C.AG_ALGOS] + [
    ("all_gather", _dims(4, 8192), BF, {"ENGINE": "ce", "COMM_SMS": 1}),
    ("all_gather", _dims(1024, 8192), BF, {"ALGO": "push", "COMM_SMS": 64, "BLOCK": 8192, "num_warps": 8}),
    ("all_gather", _dims(1024, 8192), HALF, {"ENGINE": "ce", "COMM_SMS": 1}),
    ("all_gather", _dims(100, 4096, 1), BF, {"ALGO": "inbox", **GPU_SMALL, "CHUNKS": 4}),
    ("all_gather", _dims(7, 1000), HALF, {"ALGO": "pull", **GPU_SMALL}),
    ("reduce_scatter", _dims("64W", 8192), BF, GPU_SMALL),
    ("reduce_scatter", _dims("512W", 8192), BF, {"COMM_SMS": 64, "BLOCK": 8192, "num_warps": 8, "CHUNKS": 2}),
    ("reduce_scatter", _dims("512W", 8192), BF, {"ENGINE": "ce", "COMM_SMS": 1}),
    ("reduce_scatter", _dims("3W", 1000), F32, GPU_SMALL),
    ("all_reduce", _dims(16, 8192), BF, {"ALGO": "one_shot", **GPU_SMALL}),
    ("all_reduce", _dims(16, 8192), BF, {"ALGO": "two_shot", **GPU_SMALL}),
    ("all_reduce", _dims(1023, 8192), BF, {"ALGO": "two_shot", "COMM_SMS": 64, "BLOCK": 8192, "num_warps": 8}),
    ("all_reduce", _dims(1024, 8192), HALF, {"ALGO": "one_shot", "ENGINE": "ce", "COMM_SMS": 1}),
]


def _gpu_job(world, cases):
    return _run_table(world, [_concrete(c, world.size) for c in cases])


def _copy_engine_refusal(world):
    """The message the default (symm) heap gives a copy-engine all-gather, or None if it accepted it."""
    try:
        C.build("all_gather", world, 4, 8192, torch.bfloat16, {"ENGINE": "ce", "COMM_SMS": 1}, 0)
    except InvalidConfig as exc:
        return str(exc)
    return None


def _gpu_ranks() -> int:
    """Every GPU up to 8, or harness.gpu_world() ranks where they share GPUs."""
    return harness.gpu_world() if harness.ranks_share_gpus() else min(harness.gpus(), 8)


@gpu_test()
def test_gpu_every_algorithm_with_graph_replay(monkeypatch):
    n = _gpu_ranks()
    results = spawn(_gpu_job, n, [c for c in GPU_CASES if not harness.on_copy_engine(c)], device_kind="cuda",
                    timeout_s=900)
    harness.assert_ok(results, same_bits=("all_reduce", "interleaved all_reduce"))
    if not harness.ranks_share_gpus(n):  # sharing ranks get the IPC heap by default: no symm heap to refuse
        for why in spawn(_copy_engine_refusal, n, device_kind="cuda", timeout_s=300):
            assert why is not None and "copy engine" in why
    harness.use_ipc_heap(monkeypatch)
    results = spawn(_gpu_job, n, [c for c in GPU_CASES if harness.on_copy_engine(c)], device_kind="cuda", timeout_s=900)
    harness.assert_ok(results, same_bits=("all_reduce", "interleaved all_reduce"))


def _gpu_fault_job(world, plan):
    return _fault_job(world, plan)


@gpu_test()
def test_gpu_faults_late_peer_and_skipped_call(monkeypatch):
    cases = [("all_gather", _dims(64, 8192), BF, {"ALGO": a, **GPU_SMALL}, ("late_peer", "skipped_call"))
             for a in C.AG_ALGOS]
    cases += [("all_gather", _dims(64, 8192), BF, {"ENGINE": "ce", "COMM_SMS": 1}, ("late_peer", "skipped_call")),
              ("reduce_scatter", _dims("64W", 8192), BF, GPU_SMALL, ("late_peer", "skipped_call")),
              ("all_reduce", _dims(64, 8192), BF, {"ALGO": "two_shot", **GPU_SMALL}, ("late_peer", "skipped_call"))]
    for on_ce in (False, True):
        if on_ce:
            harness.use_ipc_heap(monkeypatch)
        plan = _fault_plan(harness.gpu_world(), [c for c in cases if harness.on_copy_engine(c) == on_ce])
        results = spawn(_gpu_fault_job, harness.gpu_world(), plan, device_kind="cuda", timeout_s=900)
        for i in range(len(plan)):
            harness.check_fault_run([r[i] for r in results])


def _graph_late_peer(world):
    """A captured all-gather replayed while the last rank is late past the budget: every rank raises."""
    import time

    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)
    coll = C.all_gather(world, 64, 8192, torch.bfloat16, {"ALGO": "inbox", **GPU_SMALL}, name="graph_fault")
    x = torch.randn(64, 8192, device=world.device).bfloat16()
    out = coll(x)
    world.sync()
    side = torch.cuda.Stream(device=world.device)
    side.wait_stream(torch.cuda.current_stream(world.device))
    with torch.cuda.stream(side):
        coll(x, out=out)
    torch.cuda.current_stream(world.device).wait_stream(side)
    world.sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        coll(x, out=out)
    g.replay()
    world.sync()
    coll.check()
    if world.rank == world.size - 1:
        time.sleep(harness.FAULT_BUDGET_S + 1.0)
    out.fill_(0)
    g.replay()
    raised = None
    try:
        coll.check()
    except status.FlagTimeout as exc:
        raised = str(exc)
    finite = bool(torch.isfinite(out).all())
    world.sync()
    return raised, finite


@gpu_test()
def test_gpu_graph_replay_with_a_late_peer_raises_everywhere():
    for raised, finite in spawn(_graph_late_peer, harness.gpu_world(), device_kind="cuda", timeout_s=300):
        assert raised is not None and not finite


# -- the bench on CPU (tiny, interpreter timings) -----------------------------------------------------
def test_bench_collectives_runs_on_cpu_and_renders_at_80_columns():
    import io
    import json
    from types import SimpleNamespace

    from rich.console import Console

    from autofuse.bench import bench_collectives as bench

    result = bench.run(SimpleNamespace(world=2, device_kind="cpu", shapes=["4K"], variants=["all_reduce", "inbox"],
                                       progress=False))
    assert result["kinds"] == ["all_gather", "all_reduce"]
    impls = {(r["kind"], r["impl"]) for r in result["rows"]}
    assert impls == {("all_gather", "gloo"), ("all_gather", "inbox"), ("all_reduce", "gloo"),
                     ("all_reduce", "one_shot"), ("all_reduce", "two_shot"), ("all_reduce", "ce"), ("all_reduce", "ll")}
    assert not [r for r in result["rows"] if r["error"]], [r for r in result["rows"] if r["error"]]
    assert all(b["best"] is not None for b in result["best"])
    json.dumps(result, allow_nan=True)
    text = io.StringIO()
    bench.render(result, Console(file=text, width=80, markup=False))
    out = text.getvalue()
    assert "CPU emulation" in out and "one_shot" in out and "ll" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "x gloo" not in out and "bus GB/s" not in out  # interpreter timings: never a speedup


def test_collective_sweep_script_checks_times_and_profiles_every_config(tmp_path):
    """scripts/collective_sweep.py's CPU dry run: every config of its grid is checked against the
    library and timed (none fails), the best is the fastest row, and both profiles were taken."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "collective_sweep.py"), "--kind",
                           "reduce_scatter", "--sizes", "8K", "--reps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    (entry,) = json.loads(out.read_text())["sizes"]
    assert len(entry["rows"]) == 3 and not [r for r in entry["rows"] if r["error"]], entry["rows"]
    assert entry["best"]["us"] == min(r["us"] for r in entry["rows"])
    assert entry["library_profile"]["calls"] > 0 and entry["best_profile"]["calls"] > 0
    assert "8 KB per rank" in done.stdout and "profile best" in done.stdout


def test_reductions_refuse_fp8_all_gather_moves_it():
    """FP8 moves as bytes in an all-gather (ag_gemm's FP8 A); a sum of FP8 values is never taken:
    gemm_rs / gemm_ar reduce the bf16 result of the scaled product."""
    from autofuse.core.op import InvalidInput

    C._check_dtype("all_gather", torch.float8_e4m3fn)
    for kind in ("reduce_scatter", "all_reduce"):
        with pytest.raises(InvalidInput, match="does not sum float8_e4m3fn"):
            C._check_dtype(kind, torch.float8_e4m3fn)
