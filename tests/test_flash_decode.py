"""flash_decode: every variant against a float64 reference, on CPU ranks (Triton interpreter) and GPUs.

One case table (`VARIANTS` on top of each variant's first default config) runs on tiny problems at 2
and 4 CPU ranks and at GPU sizes with CUDA-graph replay (`pytest -m gpu`), through harness.run_cases.
Inputs are ragged (`fd.make_inputs`): seed 0 has a full sequence per rank and, at B >= 3, one empty
on that rank, K/V sliced from a longer cache; seeds 1 and 100 (run_cases' interleaved call) add a rank
with no tokens and a sequence with no tokens anywhere, K/V a (B, S, Hkv, D) cache viewed as (B, Hkv,
S, D). Outputs are NaN-poisoned before every call and must match on every rank bit for bit. Fault
tests: harness.fault_run for the variants on the heap workspace. sm_90 compiles: Triton 3.9 (this
venv) and 3.6 (AUTOFUSE_T36_PYTHON, the GPU machines'). bf16 errors here are ~3x the GPU's: the interpreter
truncates fp32 -> bf16 instead of rounding.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

import harness
from conftest import CTX, VERSIONS, assert_uniform, compile_request, compile_sm90_versions

from autofuse.core.op import InvalidConfig, InvalidInput, rel_error
from autofuse.ops import flash_decode as fd
from autofuse.comm.workspace import workspaces
from autofuse.comm.world import World, spawn

SAME_BITS = ("bsp", "split_heap", "push_fused")

# ------------------------------------------------------------------------------------ case table
# Two programs (or more) per KV head (HEADS < G), more splits than short sequences have blocks, D
# split in 16-column merge programs.
SPLIT_WIDE = {"HEADS": 2, "NUM_SPLITS": 4, "BLOCK_D": 16}
# (variant, changes to the variant's first default config); keys a variant does not take are dropped.
VARIANTS = [
    ("bsp", {}),
    ("split_heap", {"FLAG": "tile"}),
    ("split_heap", {"FLAG": "row_block"}),
    ("split_heap", {"FLAG": "shard"}),
    ("push_fused", {}),
    ("bsp", SPLIT_WIDE),
    ("split_heap", SPLIT_WIDE),
    ("push_fused", SPLIT_WIDE),
]


def cases(problems: list[tuple[dict, str]], variants=VARIANTS, world_size: int = 2) -> list[harness.Case]:
    """Every (variant, changes) on every (dims, dtype), on top of the variant's first default."""
    out = []
    for dims, dtype in problems:
        p = harness.problem_of(fd.OP, world_size, dims, dtype)
        for name, change in variants:
            var = fd.OP.variant(name)
            cfg = dict(var.defaults(p)[0], **{k: v for k, v in change.items() if k in var.defaults(p)[0]})
            out.append((name, dims, dtype, cfg))
    return out


def _dims(B: int, Hq: int, Hkv: int, D: int, S: int) -> dict:
    return {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S}


CPU_TWO = (cases([(_dims(2, 4, 2, 16, 24), "bfloat16")], VARIANTS[:5])
           + cases([(_dims(2, 4, 1, 32, 24), "float16")], VARIANTS[5:])
           + cases([(_dims(1, 2, 1, 64, 20), "bfloat16")], [("split_heap", {"BLOCK_D": 32})])
           + cases([(_dims(2, 2, 2, 128, 16), "float16")], [("push_fused", {})]))
CPU_FOUR = cases([(_dims(2, 4, 2, 16, 24), "float16")], [("bsp", {}), ("split_heap", {"FLAG": "row_block"}),
                                                         ("push_fused", {})], world_size=4)
# GPU sizes, off the tuning sweeps too: ragged, S not a multiple of BLOCK_N, several GQA groups, D 64..256.
GPU_PROBLEMS = [(_dims(1, 64, 8, 128, 1024), "bfloat16"), (_dims(3, 32, 8, 128, 5000), "float16"),
                (_dims(8, 64, 8, 64, 2048), "bfloat16"), (_dims(2, 16, 2, 256, 777), "float16"),
                (_dims(16, 64, 8, 128, 65536), "bfloat16"), (_dims(5, 128, 8, 128, 12345), "bfloat16")]


# Ragged inputs on every device (the op's own inputs are full on GPUs, for the bandwidth figures).
RAGGED = dataclasses.replace(fd.OP, inputs=lambda w, p, s: fd.make_inputs(w, p, s, ragged=True),
                             reference=lambda w, p, s: fd.reference(w, p, s, ragged=True))

# Fault runs: (variant, dims, scenario, calls). One KV head read by one program per sequence (G = 8),
# so B=8 has 4x the waiting programs of B=2.
SMALL, LARGE = _dims(2, 8, 1, 16, 16), _dims(8, 8, 1, 16, 16)
FAULT_LOCAL = {"NUM_SPLITS": 1, "BLOCK_N": 16, "HEADS": 8, "num_warps": 1, "num_stages": 1}
FAULT_CONFIGS = {"split_heap": dict(FAULT_LOCAL, BLOCK_D=16, FLAG="tile"), "push_fused": FAULT_LOCAL}
FAULTS_TWO = [(v, SMALL, s, 3 if s == "skipped_call" else 2) for v in ("split_heap", "push_fused")
              for s in ("late_peer", "skipped_call", "dead_peer")] + \
             [(v, LARGE, "dead_peer", 2) for v in ("split_heap", "push_fused")]
FAULTS_FOUR = [("push_fused", SMALL, "skipped_call", 3)]


def _empty_sequence_is_zero(world, case: harness.Case) -> float:
    """Seed 1 leaves sequence 0 without tokens on every rank (and rank 0 without any): its output
    must be exactly 0; returns its largest magnitude."""
    name, dims, dtype, cfg = case
    p = harness.problem_of(fd.OP, world.size, dims, dtype)
    runner = fd.OP.variant(name).build(world, p, cfg)
    q, k, v, n = fd.make_inputs(world, p, 1, ragged=True)
    out = runner(q, k, v, n, out=torch.full_like(q, float("nan")))
    runner.check()
    return float(out[0].float().abs().max())


def _faults(world, runs: list[tuple], configs: dict = FAULT_CONFIGS) -> list[dict]:
    """harness.fault_run for each (variant, dims, scenario, calls) on a fresh World (a new process
    group, so a heap and workspaces of its own, made under fault_run's short wait budget; the case
    table's keep the default one), rebuilding its workspaces after each run."""
    fresh = World.from_group(dist.new_group(ranks=list(world.global_ranks), backend=world.backend))
    out = []
    try:
        for variant, dims, scenario, calls in runs:
            res = harness.fault_run(fresh, RAGGED, variant, dims, "float16", configs[variant], scenario, calls)
            out.append(dict(res, variant=variant, B=dims["B"]))
            for ws in workspaces(fresh):
                ws.rebuild()
    finally:
        fresh.close()
    return out


def _entry_point(world, case: harness.Case) -> float:
    """autofuse.flash_decode (the generated public entry point) with the case's variant forced, on a
    sliced cache: relative error against the reference."""
    import autofuse

    name, dims, dtype, _ = case
    p = harness.problem_of(fd.OP, world.size, dims, dtype)
    q, k, v, n = fd.make_inputs(world, p, 0, ragged=True)
    out = autofuse.flash_decode(q, k, v, n, group=world.group, variant=name)
    return rel_error(out, fd.reference(world, p, 0, ragged=True))


def _job(world, table: list[harness.Case], calls: int, faults: list[tuple]):
    """The case table (harness.run_cases), the empty-sequence check, the public entry point, then the fault runs."""
    rows = harness.run_cases(world, RAGGED, table, calls=calls)
    rows.append(("entry point " + table[1][0], _entry_point(world, table[1]), fd.OP.tolerance(
        harness.problem_of(fd.OP, world.size, table[1][1], table[1][2])), 0))
    zero = _empty_sequence_is_zero(world, next(c for c in table if c[0] == "split_heap" and c[1]["B"] >= 2))
    return rows, zero, _faults(world, faults)


def _assert_cases(results) -> None:
    harness.assert_ok([rows for rows, _, _ in results], same_bits=SAME_BITS)
    assert all(zero == 0.0 for _, zero, _ in results), [zero for _, zero, _ in results]


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_job, 2, CPU_TWO, 1, FAULTS_TWO, device_kind="cpu")


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(_job, 4, CPU_FOUR, 1, FAULTS_FOUR, device_kind="cpu")


@pytest.mark.timeout(600)
def test_two_ranks_case_table(two_ranks):
    _assert_cases(two_ranks)
    assert len(two_ranks[0][0]) == len(CPU_TWO) + 1 == 11  # the case table and the entry point


@pytest.mark.timeout(600)
def test_four_ranks_case_table(four_ranks):
    _assert_cases(four_ranks)


@pytest.mark.timeout(600)
def test_faults_two_ranks(two_ranks):
    """Late peer, skipped call and dead peer: every rank raises within the budget, nothing wrong is
    returned; a dead peer at B=8 (4x the waiting programs) fails within the same bound as at B=2
    (a per-program budget took 26 s vs 104 s here last round)."""
    for i in range(len(FAULTS_TWO)):
        harness.check_fault_run([faults[i] for _, _, faults in two_ranks])
    dead = [r for r in two_ranks[0][2] if r["scenario"] == "dead_peer"]
    assert sorted((r["variant"], r["B"]) for r in dead) == [("push_fused", 2), ("push_fused", 8),
                                                            ("split_heap", 2), ("split_heap", 8)]
    assert all(r["first_fault_s"] is not None for r in dead), dead


@pytest.mark.timeout(600)
def test_fault_four_ranks(four_ranks):
    harness.check_fault_run([faults[0] for _, _, faults in four_ranks])
    assert all(faults[0]["first_fault_s"] is not None for _, _, faults in four_ranks)  # the victim too


@harness.gpu()
@pytest.mark.timeout(900)
@pytest.mark.parametrize("part", range(2))
def test_gpu_case_table_with_graph_replay(part):
    """GPU sizes, every variant and flag granularity, eager calls and CUDA-graph replays; the problems
    in two parts (each with a batched problem for the empty-sequence check), so each part's cold
    compiles stay well inside the time limit."""
    _assert_cases(spawn(_job, harness.gpu_world(), cases(GPU_PROBLEMS[part::2]), 2, [], device_kind="cuda",
                        timeout_s=880))


@harness.gpu()
@pytest.mark.timeout(600)
def test_gpu_faults():
    dims = _dims(4, 64, 8, 128, 4096)
    runs = [(v, dims, s, 3) for v in ("split_heap", "push_fused") for s in ("late_peer", "skipped_call", "dead_peer")]
    world = harness.gpu_world()
    gpu_configs = {v: fd.OP.variant(v).defaults(harness.problem_of(fd.OP, world, dims, "float16"))[0]
                   for v in FAULT_CONFIGS}
    per_rank = spawn(_faults, world, runs, gpu_configs, device_kind="cuda")
    for i in range(len(runs)):
        harness.check_fault_run([rows[i] for rows in per_rank])


# ------------------------------------------------------------------------- inputs and configs
def _world(size: int = 2) -> World:
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


def _good(B=2, Hq=4, Hkv=2, S=16, D=16, dtype=torch.float16):
    q = torch.randn(B, Hq, D).to(dtype)
    k = torch.randn(B, Hkv, S, D).to(dtype)
    return q, k, k.clone(), torch.full((B,), S, dtype=torch.int32)


@pytest.mark.parametrize("mutate, words", [
    (lambda q, k, v, n: (q.float(), k, v, n), "dtype"),
    (lambda q, k, v, n: (q, k.to(torch.bfloat16), v, n), "dtype"),
    (lambda q, k, v, n: (q[None], k, v, n), "(B, Hq, D)"),
    (lambda q, k, v, n: (q, k[..., :8], v[..., :8], n), "match"),
    (lambda q, k, v, n: (q, k, v[:, :1], n), "(B, Hkv, S, D)"),
    (lambda q, k, v, n: (q[:, :3], k, v, n), "multiple"),
    (lambda q, k, v, n: (q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(), n), "head dim"),
    (lambda q, k, v, n: (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, n), "contiguous"),
    (lambda q, k, v, n: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, n), "unit stride"),
    (lambda q, k, v, n: (q, k, v, n.long()), "int32"),
    (lambda q, k, v, n: (q, k, v, n[:1]), "int32"),
    (lambda q, k, v, n: (q, k, v, [1, 2]), "tensor"),
])
def test_bad_inputs_raise(mutate, words):
    with pytest.raises(InvalidInput, match=re.escape(words)):
        fd.problem_of(_world(), *mutate(*_good()))


def test_problem_runner_specs_and_strided_caches():
    p = fd.problem_of(_world(), *_good())
    assert (p["B"], p["Hq"], p["Hkv"], p["S"], p["D"], p.world) == (2, 4, 2, 16, 16, 2)
    big = torch.randn(2, 16 + 3, 2, 16).to(torch.float16)  # a (B, S, Hkv, D) cache, sliced and viewed
    q, _, _, n = _good()
    k = big[:, :16].transpose(1, 2)
    assert fd.problem_of(_world(), q, k, k, n) == p
    with pytest.raises(InvalidInput, match="ranks"):
        fd.OP.variant("bsp").build(_world(4), p, fd.OP.variant("bsp").defaults(p)[0])
    assert fd.OP.args == ("q", "k", "v", "lengths")
    assert {v.name: v.family for v in fd.OP.variants.values()} == {
        "bsp": "bsp", "split_heap": "hybrid", "push_fused": "fused"}


@pytest.mark.parametrize("variant, change, words", [
    ("bsp", {"BLOCK_N": 8}, "BLOCK_N"),
    ("bsp", {"NUM_SPLITS": 0}, "NUM_SPLITS"),
    ("bsp", {"HEADS": 3}, "HEADS"),
    ("bsp", {"num_warps": 3}, "num_warps"),
    ("bsp", {"num_stages": 9}, "num_stages"),
    ("bsp", {"BLOCK_D": 512}, "BLOCK_D"),
    ("bsp", {"FLAG": "tile"}, "keys"),
    ("split_heap", {"FLAG": "head"}, "FLAG"),
    ("push_fused", {"BLOCK_D": 64}, "keys"),
    ("push_fused", {"BLOCK_N": 256, "num_stages": 4}, "shared memory"),
])
def test_invalid_configs(variant, change, words):
    p = fd.make_problem(2, 4, 4096, D=256)
    var = fd.OP.variant(variant)
    base = var.defaults(p)[0]
    cfg = {**base, **change}
    assert var.check(p, base) is None
    reason = var.check(p, cfg)
    assert reason and words in reason
    with pytest.raises(InvalidConfig, match=words):
        var.build(_world(), p, cfg)


def test_sweeps_defaults_space_and_extras():
    import optuna

    sizes = {kind: len(fd.OP.sweep(kind, 2)) for kind in ("cpu", "gpu", "llama70b", "models", "default")}
    assert sizes == {"cpu": 3, "gpu": 23, "llama70b": 23, "models": 48, "default": 10}, sizes
    assert [p["S"] <= 16 << 10 for p in fd.OP.sweep("gpu", 2)] == [True] * 15 + [False] * 8  # --limit 15
    heads = {(p["Hq"], p["Hkv"], p["D"]) for p in fd.OP.sweep("models", 2)}
    assert heads == {(32, 8, 128), (64, 8, 128), (128, 8, 128)}
    assert {p["B"] for p in fd.OP.sweep("models", 2)} == {1, 8, 32, 128}
    for kind in ("cpu", "gpu", "models", "default"):
        for p in fd.OP.sweep(kind, 2):
            for name, var in fd.OP.variants.items():
                for cfg in var.defaults(p):
                    assert var.check(p, cfg) is None, (name, p, cfg)
            assert set(fd.OP.features(p)) and fd.OP.bytes_read(p) > 0
    with pytest.raises(ValueError, match="sweep kind"):
        fd.OP.sweep("nope", 2)
    # the split kernel fills the GPU; the merge programs reach the SMs at B=1 (D split in 4)
    short, long = fd.make_problem(2, 1, 1 << 10), fd.make_problem(2, 1, 64 << 10)
    assert all(c["NUM_SPLITS"] * 8 >= 2 * fd.GPU_SMS for c in fd.OP.variant("bsp").defaults(long))
    assert [c["NUM_SPLITS"] * c["BLOCK_N"] for c in fd.OP.variant("bsp").defaults(short)] == [256, 1024]
    assert [c["BLOCK_D"] for c in fd.OP.variant("split_heap").defaults(short)] == [32, 32]
    assert fd.OP.variant("split_heap").defaults(fd.make_problem(2, 32, 1 << 10))[0]["BLOCK_D"] == 128
    study = optuna.create_study()
    for _ in range(20):
        cfg = fd.OP.variant("split_heap").space(study.ask(), short)
        assert set(cfg) == set(fd.LOCAL_KEYS) | {"BLOCK_D", "FLAG"}
        reason = fd.OP.variant("split_heap").check(short, cfg)
        assert reason is None or "shared" in reason or "live" in reason, reason
    assert fd.kv_bytes(short) == 2 * 8 * 1024 * 128 * 2 + 64 * 128 * 2
    assert fd.OP.bound is fd.bound and fd.OP.bytes_read is fd.kv_bytes and fd.OP.copy_rate is fd.copy_rate


def test_ragged_inputs_cover_the_patterns():
    world = _world(2)
    p = fd.make_problem(2, 3, 8, Hq=4, Hkv=2, D=16, dtype="float16")
    _, k0, _, n0 = fd.make_inputs(world, p, 0, rank=1, ragged=True)
    _, k1, _, n1 = fd.make_inputs(world, p, 1, rank=0, ragged=True)
    _, _, _, n1b = fd.make_inputs(world, p, 1, rank=1, ragged=True)
    assert not k0.is_contiguous() and k0.stride(2) == 16 and k1.stride(2) == 2 * 16  # sliced; (B, S, H, D) view
    assert n0[1] == 8 and n0[2] == 0 and n0[0] > 0    # a full and an empty sequence on this rank
    assert n1.tolist() == [0, 0, 0]                   # seed 1: rank 0 holds no tokens
    assert n1b[0] == 0 and n1b[1] == 8                # and sequence 0 is empty on every rank
    # at B = 2 both ranks hold tokens of both sequences (seed 0): the merge of ranks is exercised
    p2 = fd.make_problem(2, 2, 8, Hq=4, Hkv=2, D=16, dtype="float16")
    assert all(bool((fd.make_inputs(world, p2, 0, rank=r, ragged=True)[3] > 0).all()) for r in (0, 1))


# ----------------------------------------------------------------------------- sm_90 compile
KMOD = "autofuse.kernels.flash_decode"
_I = "i32"
_STRIDES = {f"stride_{t}{d}": _I for t in "kv" for d in "bhs"}
SPLIT_SIG = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "lengths": "*i32", "o_split": "*fp32", "lse_split": "*fp32",
             "S": _I, "Hq": _I, "Hkv": _I, "HEADS": _I, "num_splits": _I, **_STRIDES, "scale": "fp32",
             "D": "constexpr", "BLOCK_N": "constexpr", "BLOCK_H": "constexpr"}
MERGE_SPLITS_SIG = {"o_split": "*fp32", "lse_split": "*fp32", "slot": "*fp32", "n_rows": _I, "HEADS": _I,
                    "num_splits": _I, "D": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr",
                    "SPLIT_BLOCK": "constexpr"}
MERGE_RANKS_SIG = {"slots": "*fp32", "out": "*bf16", "slot_stride": _I, "n_rows": _I, "HEADS": _I, "world": _I,
                   "D": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
COMBINE_SIG = {"o_split": "*fp32", "lse_split": "*fp32", "inbox": "*fp32", "flags": "*i32", "out": "*bf16",
               "ctx": CTX, "n_rows": _I, "GROUP_ROWS": _I, "num_splits": _I, "slot_stride": _I, "inbox_half": _I,
               "flags_half": _I, "D": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr",
               "SPLIT_BLOCK": "constexpr"}
FUSED_SIG = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "lengths": "*i32", "o_split": "*fp32", "lse_split": "*fp32",
             "arrivals": "*i32", "inbox": "*fp32", "flags": "*i32", "out": "*bf16", "ctx": CTX, "S": _I, "Hq": _I,
             "Hkv": _I, "HEADS": _I, "num_splits": _I, "slot_stride": _I, "inbox_half": _I, "flags_half": _I,
             **_STRIDES, "scale": "fp32", "D": "constexpr", "BLOCK_N": "constexpr", "BLOCK_H": "constexpr",
             "BLOCK_R": "constexpr", "SPLIT_BLOCK": "constexpr"}


def _req(name: str, kernel: str, sig: dict, constexprs: dict, warps: int, stages: int) -> dict:
    """A compile request, pointers and strides divisible by 16 as Triton specialises them at a real launch."""
    divisible = [a for a, t in sig.items() if a != "ctx" and (t.startswith("*") or "stride" in a or "half" in a)]
    return compile_request(KMOD, kernel, sig, constexprs, warps, stages, divisible, name=name)


GPU_BLOCKS = {"D": 128, "BLOCK_N": 64, "BLOCK_H": 16}
COMPILES = [
    _req("split", "split_kernel", SPLIT_SIG, GPU_BLOCKS, 4, 3),
    _req("split_d64", "split_kernel", {**SPLIT_SIG, "q": "*fp16", "k": "*fp16", "v": "*fp16"},
         dict(GPU_BLOCKS, D=64, BLOCK_N=128), 4, 3),
    _req("merge_splits", "merge_splits_kernel", MERGE_SPLITS_SIG,
         {"D": 128, "BLOCK_R": 8, "BLOCK_D": 32, "SPLIT_BLOCK": 32}, 4, 1),
    _req("merge_ranks", "merge_ranks_kernel", MERGE_RANKS_SIG, {"D": 128, "BLOCK_R": 8, "BLOCK_D": 32}, 4, 1),
    _req("combine_tile", "heap_combine_kernel", COMBINE_SIG,
         {"D": 128, "BLOCK_R": 8, "BLOCK_D": 32, "SPLIT_BLOCK": 32}, 4, 1),
    _req("combine_shard", "heap_combine_kernel", COMBINE_SIG,
         {"D": 128, "BLOCK_R": 16, "BLOCK_D": 128, "SPLIT_BLOCK": 4}, 4, 1),
    _req("fused", "fused_kernel", FUSED_SIG, dict(GPU_BLOCKS, BLOCK_R=8, SPLIT_BLOCK=4), 4, 3),
]

@pytest.fixture(scope="module")
def compiled() -> dict:
    """{version: {name: {'ptx', 'shared'}}}: "current" (this venv's Triton) and "3.6" (conftest.T36,
    when it exists), compiled in parallel child processes."""
    return compile_sm90_versions(COMPILES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", VERSIONS)
def test_kernels_compile_for_sm90(compiled, version):
    """The split kernel streams K/V with cp.async into tensor-core products and fits the shared-memory
    estimate; the heap kernels push with system-scope releases, poll with volatile loads bounded by
    %globaltimer and read split partials past L1; the fused kernel counts arrivals with a GPU-scope
    acq_rel atomic."""
    k = compiled[version]
    for name in k:
        assert_uniform(k[name], name)  # every fault decision is the program's
    for name in ("split", "split_d64", "fused"):
        ptx = k[name]["ptx"]
        assert "cp.async.cg" in ptx and "cp.async.wait_group" in ptx, f"{name}: K/V loads not pipelined"
        assert "mma.sync" in ptx or "wgmma" in ptx, f"{name}: no tensor-core product"
        d, bn = (64, 128) if name == "split_d64" else (128, 64)
        p = fd.make_problem(2, 4, 4096, D=d)
        cfg = {"NUM_SPLITS": 4, "BLOCK_N": bn, "HEADS": 8, "num_warps": 4, "num_stages": 3}
        assert k[name]["shared"] <= fd.smem_bytes(p, cfg), (name, k[name]["shared"], fd.smem_bytes(p, cfg))
    for name in ("combine_tile", "combine_shard", "fused"):
        ptx = k[name]["ptx"]
        assert re.search(r"atom\.global\.(sys\.release|release\.sys)\.exch", ptx), f"{name}: no sys release flag"
        assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, f"{name}: wait not polled/bounded"
        assert "ld.global.cg" in ptx, f"{name}: split partials read through L1"
    assert "atom.global" not in k["merge_splits"]["ptx"] + k["merge_ranks"]["ptx"]  # BSP merges touch no flags
    assert "atom.global.gpu.acq_rel.add" in k["fused"]["ptx"]
    assert re.search(r"st\.global\.v[24]\.b32", k["combine_tile"]["ptx"]), "pushes are not vector stores"
