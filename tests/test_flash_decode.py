"""flash_decode on CPU ranks (Triton interpreter): every variant against a float64 reference.

One spawn per world size loops over variants, dtypes, head dims and length patterns (ragged, a
rank holding no tokens, a sequence with no tokens anywhere) and repeated calls (parity buffers),
and returns (case, error, tolerance) rows; the tests assert on them, naming the failing cases.
bf16 errors here are ~3x the GPU's: the interpreter truncates fp32 -> bf16 instead of rounding.
"""
from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch

from conftest import compile_request, compile_sm90_many

from autofuse.op import InvalidConfig, InvalidInput, rel_error
from autofuse.ops import flash_decode as fd
from autofuse.world import World, spawn

KMOD = "autofuse.kernels.flash_decode"


def _run(world, runner, q, k, v, lengths) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    runner(q, k, v, lengths, out=out)
    return out


def _row(case: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[str, float, float, str]:
    """(case, error, tolerance, digest of the output's bits: every rank must return the same)."""
    return case, rel_error(out, ref), tol, hashlib.sha1(out.contiguous().view(torch.uint8).numpy()).hexdigest()


def _gathered_reference(world, q, k, v, lengths) -> torch.Tensor:
    """Reference over every rank's actual inputs (gathered), for hand-made lengths."""
    ks = [torch.empty_like(k) for _ in range(world.size)]
    vs = [torch.empty_like(v) for _ in range(world.size)]
    ns = [torch.empty_like(lengths) for _ in range(world.size)]
    torch.distributed.all_gather(ks, k.contiguous(), group=world.group)
    torch.distributed.all_gather(vs, v.contiguous(), group=world.group)
    torch.distributed.all_gather(ns, lengths, group=world.group)
    return fd.attention_reference(q, ks, vs, ns)


def _cases(world, calls: int, configs: list[tuple[str, str | None]], problems) -> list[tuple[str, float, float]]:
    from autofuse import status

    rows = []
    for p in problems:
        tol = fd.OP.tolerance(p)
        for name, flags in configs:
            var = fd.OP.variant(name)
            cfg = var.defaults(p)[0]
            if flags:
                cfg = dict(cfg, flags=flags)
            runner = var.build(world, p, cfg)
            for call in range(calls):
                seed = 100 * call + p["D"]
                q, k, v, n = fd.make_inputs(world, p, seed)
                out = _run(world, runner, q, k, v, n)
                status.check(world.heap, f"flash_decode.{name}")
                rows.append(_row(f"{name}/{flags}/{p}/call{call}", out, fd.reference(world, p, seed), tol))
            # hand-made lengths: sequence 0 empty on every rank, a strided (non-contiguous) cache
            q, k, v, n = fd.make_inputs(world, p, 7)
            n = n.clone()
            n[0] = 0
            big_k = torch.randn(p["B"], p["Hkv"], p["S"] + 16, p["D"]).to(k.dtype)
            big_k[:, :, :p["S"]] = k
            ks = big_k[:, :, :p["S"]]
            out = _run(world, runner, q, ks, v, n)
            status.check(world.heap, f"flash_decode.{name}")
            ref = _gathered_reference(world, q, k, v, n)
            rows.append(_row(f"{name}/{flags}/{p}/empty-seq0+strided", out, ref, tol))
            rows.append((f"{name}/{flags}/{p}/empty-seq0 is zero", float(out[0].abs().max()), 0.0, ""))
    return rows


ALL = [("bsp", None), ("push", "head"), ("push", "batch"), ("push", "all"), ("push_fused", None)]


def _job2(world):
    problems = [fd.make_problem(world.size, 2, 48, Hq=4, Hkv=2, D=16, dtype="bfloat16"),
                fd.make_problem(world.size, 2, 40, Hq=8, Hkv=2, D=32, dtype="float16")]
    rows = _cases(world, 5, ALL, problems[:1])
    rows += _cases(world, 2, ALL, problems[1:])
    # HEADS < G (two programs per KV head); more splits than blocks; D=256 merges 32 splits in 2 round trips
    p256 = fd.make_problem(world.size, 1, 288, Hq=2, Hkv=1, D=256, dtype="float16")
    for name, p, change in (("bsp", problems[1], {"HEADS": 2, "NUM_SPLITS": 4}),
                            ("push", problems[1], {"HEADS": 2, "NUM_SPLITS": 4}),
                            ("push_fused", problems[1], {"HEADS": 2, "NUM_SPLITS": 4}),
                            ("bsp", p256, {"NUM_SPLITS": 32}), ("push_fused", p256, {"NUM_SPLITS": 32})):
        var = fd.OP.variant(name)
        cfg = dict(var.defaults(p)[0], **change)
        runner = var.build(world, p, cfg)
        q, k, v, n = fd.make_inputs(world, p, 3)
        rows.append(_row(f"{name}/{change}/{p}", _run(world, runner, q, k, v, n), fd.reference(world, p, 3),
                         fd.OP.tolerance(p)))
    rows.append(("a lone rank's wait times out", _lone_call_times_out(world, problems[0]), 0.0, ""))
    return rows


def _lone_call_times_out(world, p) -> float:
    """Only rank 0 calls push: its bounded wait must give up and the host raise FlagTimeout
    naming the op and flag (0.0 when it does). Leaves the flags out of step: run it last."""
    from autofuse.status import FlagTimeout, check

    os.environ["AUTOFUSE_SPIN_LIMIT"] = "200"
    try:
        runner = fd.OP.variant("push").build(world, p, fd.OP.variant("push").defaults(p)[0])
    finally:
        del os.environ["AUTOFUSE_SPIN_LIMIT"]
    result = 0.0
    if world.rank == 0:
        runner(*fd.make_inputs(world, p, 1))
        try:
            check(world.heap, "flash_decode.push")
            result = 1.0
        except FlagTimeout as exc:
            result = 0.0 if "flash_decode.push" in str(exc) and "flags[" in str(exc) else 2.0
    world.barrier()
    return result


def _job4(world):
    p = fd.make_problem(world.size, 2, 32, Hq=4, Hkv=2, D=16, dtype="float16")
    rows = _cases(world, 5, [("push", "head"), ("push_fused", None)], [p])
    rows += _cases(world, 1, [("bsp", None), ("push", "batch")], [p])
    return rows


def _assert_rows(per_rank) -> None:
    """Every case within tolerance on every rank, with the same output bits on every rank."""
    bad = [f"rank {r} {case}: {err:.3g} > {tol:.3g}" for r, rows in enumerate(per_rank)
           for case, err, tol, _ in rows if not err <= tol]
    assert not bad, "wrong results:\n" + "\n".join(bad)
    digests = [[(case, digest) for case, _, _, digest in rows] for rows in per_rank]
    differ = [a[0] for a, *others in zip(*digests) if any(o != a for o in others)]
    assert not differ, f"ranks returned different outputs for {differ}"
    assert len(per_rank[0]) >= 10


@pytest.mark.timeout(400)
def test_two_ranks_every_variant():
    _assert_rows(spawn(_job2, 2))


@pytest.mark.timeout(400)
def test_four_ranks_repeated_calls():
    _assert_rows(spawn(_job4, 4))


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
    with pytest.raises(InvalidInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        fd.problem_of(_world(), *mutate(*_good()))


def test_problem_and_runner_shape_checks():
    p = fd.problem_of(_world(), *_good())
    assert (p["B"], p["Hq"], p["Hkv"], p["S"], p["D"], p.world) == (2, 4, 2, 16, 16, 2)
    with pytest.raises(InvalidInput, match="ranks"):
        fd.OP.variant("bsp").build(_world(4), p, fd.OP.variant("bsp").defaults(p)[0])


@pytest.mark.parametrize("variant, change, words", [
    ("bsp", {"BLOCK_N": 8}, "BLOCK_N"),
    ("bsp", {"NUM_SPLITS": 0}, "NUM_SPLITS"),
    ("bsp", {"HEADS": 3}, "HEADS"),
    ("bsp", {"num_warps": 3}, "num_warps"),
    ("bsp", {"num_stages": 9}, "num_stages"),
    ("bsp", {"flags": "head"}, "keys"),
    ("push", {"flags": "tile"}, "flags"),
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


def test_defaults_space_sweep_and_extras():
    import optuna

    for kind in ("cpu", "gpu"):
        for p in fd.OP.sweep(kind, 2):
            for name, var in fd.OP.variants.items():
                for cfg in var.defaults(p):
                    assert var.check(p, cfg) is None, (name, p, cfg)
            assert set(fd.OP.features(p)) and fd.OP.extra["bytes"](p) > 0
    long = fd.make_problem(2, 1, 64 << 10)
    assert fd.OP.variant("bsp").defaults(long)[0]["NUM_SPLITS"] * 8 >= 2 * fd.GPU_SMS   # fills the GPU
    p = fd.make_problem(2, 1, 1 << 10)
    study = optuna.create_study()
    for _ in range(20):
        cfg = fd.OP.variant("push").space(study.ask(), p)
        assert set(cfg) == set(fd.KEYS) | {"flags"}
        assert fd.OP.variant("push").check(p, cfg) is None or "shared" in fd.check(p, cfg, True) or "live" in \
            fd.check(p, cfg, True)
    assert fd.kv_bytes(p) == 2 * 8 * 1024 * 128 * 2 + 64 * 128 * 2


# ----------------------------------------------------------------------------- sm_90 compile
_I = "i32"
SPLIT_SIG = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Lengths": "*i32", "PartO": "*fp32", "PartLse": "*fp32",
             "S": _I, "Hq": _I, "Hkv": _I, "G": _I, "HEADS": _I, "num_splits": _I, "stride_kb": _I, "stride_kh": _I,
             "stride_ks": _I, "stride_vb": _I, "stride_vh": _I, "stride_vs": _I, "scale": "fp32",
             "D": "constexpr", "BLOCK_N": "constexpr", "BLOCK_H": "constexpr", "UPCAST": "constexpr"}
LOCAL_SIG = {"PartO": "*fp32", "PartLse": "*fp32", "Dest": "*fp32", "Flags": "*i32", "Arrive": "*i32",
             "Counter": "*i32", "n_rows": _I, "slot_stride": _I, "num_splits": _I, "rows_per_flag": _I,
             "flag_stride": _I, "rank": _I, "world": _I, "heap_bases": "*i64",
             "PUSH": "constexpr", "D": "constexpr", "SPLIT_BLOCK": "constexpr"}
GLOBAL_SIG = {"Src": "*fp32", "Out": "*bf16", "Flags": "*i32", "Counter": "*i32", "status": "*i32", "n_rows": _I,
              "slot_stride": _I, "Hq": _I, "Hkv": _I, "G": _I, "HEADS": _I, "rows_per_flag": _I, "flag_stride": _I,
              "rank": _I, "world": _I, "heap_bases": "*i64", "spin_limit": _I, "WAIT": "constexpr", "D": "constexpr",
              "BLOCK_H": "constexpr"}
FUSED_SIG = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Lengths": "*i32", "PartO": "*fp32", "PartLse": "*fp32",
             "Inbox": "*fp32", "Out": "*bf16", "Flags": "*i32", "Arrive": "*i32", "Counter": "*i32", "status": "*i32",
             "S": _I, "Hq": _I, "Hkv": _I, "G": _I, "HEADS": _I, "num_splits": _I, "n_rows": _I, "slot_stride": _I,
             "flag_stride": _I, "rank": _I, "world": _I, "heap_bases": "*i64", "spin_limit": _I, "stride_kb": _I,
             "stride_kh": _I, "stride_ks": _I, "stride_vb": _I, "stride_vh": _I, "stride_vs": _I, "scale": "fp32",
             "D": "constexpr", "BLOCK_N": "constexpr", "BLOCK_H": "constexpr", "SPLIT_BLOCK": "constexpr",
             "UPCAST": "constexpr"}


def _req(name, kernel, sig, constexprs, warps, stages):
    """A compile request; pointers and strides divisible by 16 as Triton's JIT specialises them at run time."""
    divisible = [a for a, t in sig.items() if t.startswith("*") or a.startswith("stride_") or a == "slot_stride"]
    return compile_request(KMOD, kernel, sig, constexprs, warps, stages, divisible, name=name)


def compile_all(reqs: list[dict]) -> dict:
    """Compile every request for sm_90 in one child process; summarise what each PTX contains."""
    out = {}
    for name, k in compile_sm90_many(reqs).items():
        ptx = k["ptx"]
        out[name] = {"shared": k["shared"], "cp_async": ptx.count("cp.async.cg"),
                     "v4_loads": len(re.findall(r"ld\.global(\.[a-z]+)*\.v4", ptx)),
                     "sys_release": "atom.global.sys.release" in ptx or "atom.release.sys" in ptx,
                     "volatile": "ld.volatile.global" in ptx, "mma": "mma.sync" in ptx}
    return out


@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90():
    """Every kernel at head dim 128 and the GPU default blocks: K/V streamed with cp.async,
    partials pushed with release/sys flags, waits polled with volatile loads."""
    blocks = {"D": 128, "BLOCK_N": 64, "BLOCK_H": 16, "UPCAST": False}
    reqs = [
        _req("split", "split_kernel", SPLIT_SIG, blocks, 4, 3),
        _req("split_d64", "split_kernel", dict(SPLIT_SIG, Q="*fp16", K="*fp16", V="*fp16"),
             dict(blocks, D=64, BLOCK_N=128), 4, 3),
        _req("local_bsp", "local_combine_kernel", LOCAL_SIG, {"PUSH": False, "D": 128, "SPLIT_BLOCK": 32}, 4, 1),
        _req("local_push", "local_combine_kernel", LOCAL_SIG, {"PUSH": True, "D": 128, "SPLIT_BLOCK": 32}, 4, 1),
        _req("global_bsp", "global_combine_kernel", GLOBAL_SIG, {"WAIT": False, "D": 128, "BLOCK_H": 16}, 4, 1),
        _req("global_push", "global_combine_kernel", GLOBAL_SIG, {"WAIT": True, "D": 128, "BLOCK_H": 16}, 4, 1),
        _req("fused", "fused_kernel", FUSED_SIG, dict(blocks, SPLIT_BLOCK=32), 4, 3),
    ]
    got = compile_all(reqs)
    for name in ("split", "split_d64", "fused"):
        assert got[name]["cp_async"] > 0 and got[name]["mma"], (name, got[name])
        cfg = {"NUM_SPLITS": 4, "BLOCK_N": 64 if name != "split_d64" else 128, "HEADS": 8, "num_warps": 4,
               "num_stages": 3}
        p = fd.make_problem(2, 4, 4096, D=128 if name != "split_d64" else 64)
        assert fd.check(p, cfg) is None
        smem_estimate = fd.smem_bytes(p, cfg)
        assert got[name]["shared"] <= smem_estimate, (name, got[name]["shared"], smem_estimate)
    for name in ("local_push", "fused"):
        assert got[name]["sys_release"], name
    for name in ("global_push", "fused"):
        assert got[name]["volatile"], name
