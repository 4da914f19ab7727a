"""Warm-up for serving on 2 CPU ranks: after `warmup_problems` in one job, a new job's first call of a
warmed shape makes no confirmation and builds no candidate (its decision comes from the online store,
nothing timed), while an unwarmed shape is still confirmed; `warmup(model, ...)` makes every first call a
parallelized model's layers make, so a forward pass at a warmed token count only hits the cache; the
command's problems (model presets, --op/--shapes/--tokens) and its run on CPU ranks; the GPU evaluation
script's CPU dry run (scripts/eval_warmup_gpu.py: cold, warmup, warm in separate jobs)."""
from __future__ import annotations

import json
import os

import pytest
from _toy_op import OP as TOY, tuned_rows

from autofuse.comm.world import spawn
from autofuse.core.op import Problem
from autofuse.measure import environment
from autofuse.tuning.fit import fit

PREDICTED = Problem.make("toy_mm", "float32", 2, M=256, N=64, K=16)  # never tuned (N 16, 32): predicted
TUNED = Problem.make("toy_mm", "float32", 2, M=1024, N=16, K=16)  # tuned: measured
UNWARMED = Problem.make("toy_mm", "float32", 2, M=512, N=64, K=16)  # predicted, never warmed


def _setup(world, data: dict, folder: str, db: str, other_host: bool) -> None:
    """This rank's policy file (its own fingerprint; `other_host`: another machine's id, so even the
    tuned problem is confirmed) and the online store, confirmation on."""
    fp = environment.fingerprint("cpu")
    if other_host:
        fp = dict(fp, machine_id="f" * 16)
    path = os.path.join(folder, f"policy-{world.rank}.json")
    with open(path, "w") as f:
        json.dump(dict(data, fingerprint=fp), f)
    os.environ.update(AUTOFUSE_POLICY=path, AUTOFUSE_ONLINE="1", AUTOFUSE_ONLINE_DB=db)


def _warm_job(world, data: dict, folder: str, db: str) -> dict:
    import torch

    from autofuse import dispatch, warmup_problems

    torch.set_num_threads(1)
    _setup(world, data, folder, db, other_host=True)
    dispatch.reset()
    first = warmup_problems([PREDICTED, TUNED.key], world, ops=[TOY])
    again = warmup_problems([PREDICTED], world, ops=[TOY])
    return {"first": first.as_dict(), "again": again.as_dict(), "text": str(first)}


def _serve_job(world, data: dict, folder: str, db: str) -> dict:
    """A new process: the first call of each warmed shape (other inputs than warmup's), then an unwarmed one."""
    import torch

    import _toy_op as toy
    from autofuse import dispatch

    torch.set_num_threads(1)
    _setup(world, data, folder, db, other_host=True)
    dispatch.reset()
    computed = environment.fingerprint.cache_info().misses  # _setup computed this kind's fingerprint
    res: dict = {}
    for name, p in (("predicted", PREDICTED), ("tuned", TUNED), ("unwarmed", UNWARMED)):
        builds, confirmations = sum(toy.BUILDS.values()), dispatch.stats.confirmations
        a, b = TOY.inputs(world, p, seed=11)
        out = dispatch.call(TOY, a, b)
        ex = dispatch.explain(TOY, a, b)
        res[name] = {"basis": ex.basis, "variant": ex.variant, "reason": ex.reason,
                     "confirmations": dispatch.stats.confirmations - confirmations,
                     "builds": sum(toy.BUILDS.values()) - builds,
                     "timed_now": ex.confirmation is not None,
                     "rel": float((out.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm())}
    res["fingerprints_computed"] = environment.fingerprint.cache_info().misses - computed
    for k in ("AUTOFUSE_POLICY", "AUTOFUSE_ONLINE", "AUTOFUSE_ONLINE_DB"):
        del os.environ[k]
    dispatch.reset()
    return res


def test_warmed_shapes_are_neither_confirmed_nor_built_again_in_a_new_process(tmp_path):
    data = fit(tuned_rows(), environment.fingerprint("cpu"), "eager", ops={"toy_mm": TOY}).data
    db = str(tmp_path / "online.db")
    warmed = spawn(_warm_job, 2, data, str(tmp_path), db)
    for r in warmed:
        first = r["first"]
        assert first["confirmation"] and first["online_db"] == db, first
        got = {w["problem"]: w for w in first["problems"]}
        assert set(got) == {PREDICTED.key, TUNED.key}, first
        # both confirmed now: one predicted, one measured by a policy from another host of this kind
        assert all(w["state"] == "new" and w["confirmed_now"] and w["basis"] == "confirmed" for w in got.values()), got
        assert first["confirmations"] == 2 and first["decisions"] == {"confirmed": 2}, first
        assert "policy matched by hardware kind (other host)" in got[TUNED.key]["reason"], got[TUNED.key]
        assert [w["state"] for w in r["again"]["problems"]] == ["cached"] and r["again"]["confirmations"] == 0, r
        assert "2 confirmed now" in r["text"], r["text"]
    served = spawn(_serve_job, 2, data, str(tmp_path), db)
    for r in served:
        for name in ("predicted", "tuned"):
            s = r[name]
            assert s["basis"] == "confirmed" and "measured on this machine earlier" in s["reason"], (name, s)
            assert s["confirmations"] == 0 and not s["timed_now"], (name, s)  # nothing timed
            assert s["builds"] == 1, (name, s)  # the chosen runner only: no candidate built (on GPUs: compiled)
            assert s["variant"] == "fused" and s["rel"] < 1e-5, (name, s)
        # the control: a shape warmup never saw is still confirmed on its first call (candidates built)
        u = r["unwarmed"]
        assert u["confirmations"] == 1 and u["timed_now"] and u["builds"] > 1, u
        # reading the online store takes the fingerprint the process has: computing the environment
        # again (every op's code digest; nvidia-smi on GPUs) was seconds of a warmed first request
        assert r["fingerprints_computed"] == 0, r


def _model_job(world, sequence_parallel: bool) -> dict:
    import warnings

    import torch

    from autofuse import dispatch, warmup
    from autofuse.nn import ColumnParallelLinear, RowParallelLinear

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # no policy on the CPU emulation: bsp, said once
    dispatch.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        ColumnParallelLinear(16, 32, group=world.group, sequence_parallel=sequence_parallel),
        RowParallelLinear(32, 16, group=world.group, sequence_parallel=sequence_parallel),
        ColumnParallelLinear(16, 32, group=world.group, sequence_parallel=sequence_parallel),  # same shapes again
        RowParallelLinear(32, 16, group=world.group, sequence_parallel=sequence_parallel),
    )
    report = warmup(model, world.group, tokens=[3, 4])
    misses = dispatch.stats.misses
    with torch.no_grad():
        for t in (3, 4):
            rows = -(-t // world.size) if sequence_parallel else t  # this rank's rows (the layers pad to W)
            model(torch.randn(rows, 16))
    return {"report": report.as_dict(), "new_misses": dispatch.stats.misses - misses, "hits": dispatch.stats.hits}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["gemm_ar", "ag_gemm+gemm_rs"])
def test_warmup_of_a_parallelized_model_leaves_only_cache_hits(sequence_parallel):
    for r in spawn(_model_job, 2, sequence_parallel):
        rep = r["report"]
        ops = sorted({w["problem"].split("|")[0] for w in rep["problems"] if w["state"] == "new"})
        assert ops == (["ag_gemm", "gemm_rs"] if sequence_parallel else ["gemm_ar"]), rep
        # distinct calls only: the second pair of layers repeats the first's shapes
        per_count = 2 if sequence_parallel else 1
        if sequence_parallel:  # 3 tokens pad to 4 on 2 ranks: the second count is the same problem
            assert sum(w["state"] == "new" for w in rep["problems"]) == per_count, rep
        else:
            assert sum(w["state"] == "new" for w in rep["problems"]) == 2 * per_count, rep
        assert not rep["confirmation"] and rep["confirmations"] == 0, rep  # CPU: confirmation off by default
        assert r["new_misses"] == 0 and r["hits"] >= 4, r


def _moe_job(world, sequence_parallel: bool) -> dict:
    import warnings

    import torch

    from autofuse import dispatch, warmup
    from autofuse.nn import ExpertParallelMoE

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dispatch.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(ExpertParallelMoE(16, 8, 4, 2, world.group, sequence_parallel=sequence_parallel)
                                  for _ in range(2)))  # the second block repeats the first's shapes
    report = warmup(model, world.group, tokens=[3, 4])
    misses = dispatch.stats.misses
    with torch.no_grad():
        for t in (3, 4):
            model(torch.randn(-(-t // world.size) if sequence_parallel else t, 16))
    return {"report": report.as_dict(), "new_misses": dispatch.stats.misses - misses, "hits": dispatch.stats.hits}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence_parallel"])
def test_warmup_of_an_expert_parallel_moe_block_leaves_only_cache_hits(sequence_parallel):
    """ExpertParallelMoE's moe_dispatch / moe_combine calls are warmed like the linears' (a served MoE model's
    first requests paid their decisions before)."""
    for r in spawn(_moe_job, 2, sequence_parallel):
        rep = r["report"]
        ops = sorted({w["problem"].split("|")[0] for w in rep["problems"] if w["state"] == "new"})
        assert ops == ["moe_combine", "moe_dispatch"], rep
        assert r["new_misses"] == 0 and r["hits"] >= 4, r


def test_preset_and_shape_problems():
    from autofuse.commands.warmup import problems_of
    from autofuse.dispatch.warmup import preset_problems

    tp = preset_problems("llama3-8b", 2, [1, 8])
    assert [p.key for p in tp] == [
        "gemm_ar|K=4096,M=1,N=4096|bfloat16|w2", "gemm_ar|K=14336,M=1,N=4096|bfloat16|w2",
        "gemm_ar|K=4096,M=8,N=4096|bfloat16|w2", "gemm_ar|K=14336,M=8,N=4096|bfloat16|w2"]
    sp = preset_problems("llama3-70b", 4, [1], sequence_parallel=True)
    assert [p.key for p in sp] == [
        "ag_gemm|K=8192,M=4,N=2560,gather=rows|bfloat16|w4", "ag_gemm|K=8192,M=4,N=14336,gather=rows|bfloat16|w4",
        "gemm_rs|K=8192,M=4,N=8192|bfloat16|w4", "gemm_rs|K=28672,M=4,N=8192|bfloat16|w4"]
    with pytest.raises(ValueError, match="unknown model"):
        preset_problems("gpt-5", 2, [1])
    got = problems_of("ag_gemm", ["N=64,K=32"], None, "2,4", 2, False, "float32")
    assert [p.key for p in got] == ["ag_gemm|K=32,M=2,N=64,gather=rows|float32|w2",
                                    "ag_gemm|K=32,M=4,N=64,gather=rows|float32|w2"]
    got = problems_of("flash_decode", ["Hq=4,Hkv=2,D=16,S=64"], None, "1", 2, False, "float32")
    assert [p.key for p in got] == ["flash_decode|B=1,D=16,Hkv=2,Hq=4,S=64|float32|w2"]


def test_warmup_command_on_cpu_ranks(tmp_path):
    """The command spawns the local ranks (2 on CPU) and reports each problem's decision, as JSON too;
    bad input fails with one line before any rank starts."""
    from typer.testing import CliRunner

    from autofuse.cli import app

    runner = CliRunner()
    env = {"XDG_DATA_HOME": str(tmp_path), "AUTOFUSE_MODELS_DIR": str(tmp_path)}
    res = runner.invoke(app, ["warmup", "--op", "gemm_ar", "--shapes", "N=16,K=32", "--tokens", "2,4",
                              "--dtype", "float32", "--json"], env=env)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert [w["problem"] for w in doc["problems"]] == ["gemm_ar|K=32,M=2,N=16|float32|w2",
                                                       "gemm_ar|K=32,M=4,N=16|float32|w2"], doc
    assert all(w["variant"] == "bsp" and w["state"] == "new" for w in doc["problems"]), doc
    assert len(doc["rank_seconds"]) == 2 and doc["confirmations"] == 0, doc
    for args, says in ((["--op", "gemm_ar"], "needs --shapes"), (["--model", "llama3-8b", "--op", "gemm_ar"], "either"),
                       (["--op", "gemm_ar", "--shapes", "N=16,K=32,M=4", "--tokens", "2"], "exactly one"),
                       (["--model", "nope"], "unknown model"), (["--op", "gemm_ar", "--shapes", "N16"], "NAME=VALUE")):
        res = runner.invoke(app, ["warmup", *args], env=env)
        assert res.exit_code == 1 and says in res.output, (args, res.output)


def test_eval_warmup_script_dry_run_warm_first_calls_confirm_nothing(tmp_path):
    """scripts/eval_warmup_gpu.py --cpu at 2 ranks on gemm_ar's first CPU problem: the cold first call
    confirms (a stand-in policy's prediction), warmup confirms it in a job of its own, and the first call
    of a third job neither confirms nor compiles, its decision read from the store warmup wrote (a
    warmup that persisted nothing would leave that call confirming again)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "warm.json"
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "eval_warmup_gpu.py"), "--cpu", "--ops",
                           "gemm_ar", "--limit", "1", "--world", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert out.exists(), (done.stdout[-2000:], done.stderr[-2000:])
    res = json.loads(out.read_text())
    (key,) = res["problems"]
    (cold,), (warm,) = res["cold"], res["warm"]
    assert cold["problem"] == warm["problem"] == key
    assert cold["confirmed"] and cold["confirm_timing_s"] is not None, cold  # the control: cold confirms
    assert res["warmup"]["confirmations"] == 1 and res["warmup"]["problems"][0]["problem"] == key, res["warmup"]
    assert not warm["confirmed"] and warm["confirm_timing_s"] is None and warm["compiles"] == 0, warm
    assert warm["basis"] == "confirmed" and "measured on this machine earlier" in warm["reason"], warm
    assert done.returncode == 0 and "target 0: met" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    assert not os.path.exists(res["folders"]), res["folders"]  # its temporary folders are removed
