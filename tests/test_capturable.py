"""Variants that cannot be captured in a CUDA graph (`Variant.capturable` False: MoE's bsp reads the routing
counts on the host): graph-mode timing times them eagerly and marks the measurement `timed_eager`, in every
timing path (measure, measure_in_turns, confirm on first use), and show/export star them. CPU ranks cannot
capture graphs, which makes the choice visible here: a graph-mode timing on CPU fails for a capturable
variant and runs (eagerly) for a non-capturable one."""
from __future__ import annotations

import json

from autofuse.comm.world import spawn
from autofuse.core import registry
from autofuse.core.op import Problem, Variant
from autofuse.measure import environment
from autofuse.measure.store import Store
from autofuse.measure.timing import Measurement, timed_mode
from autofuse.ops import moe


def test_the_timed_mode_of_a_variant():
    class Host(Variant):
        name, family, capturable = "host", "bsp", False

    plain = Variant("plain", "bsp")
    assert plain.capturable and timed_mode(plain, "graph") == "graph" and timed_mode(plain, "eager") == "eager"
    assert timed_mode(Host(), "graph") == "eager" and timed_mode(Host(), "eager") == "eager"
    assert not registry.get("moe_dispatch").variant("bsp").capturable
    assert not registry.get("moe_combine").variant("bsp").capturable
    others = [(op, v) for op in registry.names() if not op.startswith("moe_") for v in registry.get(op).variants]
    assert others and all(registry.get(op).variant(v).capturable for op, v in others)


def _graph_mode_on_cpu(world) -> dict:
    from autofuse.dispatch import confirm
    from autofuse.measure.timing import measure, measure_in_turns

    op = registry.get("moe_dispatch")
    p = moe.make_problem(moe.DISPATCH, "float32", world.size, 2, 8, 4, 2 * world.size, 2, "swiglu")
    (graph,) = measure(world, op, p, "bsp", {}, modes=("graph",), reps=2, warmup=1)
    eager = measure(world, op, p, "bsp", {}, modes=("eager",), reps=2, warmup=1)[0]
    (turns,) = measure_in_turns(world, op, p, [("bsp", {})], modes=("graph",), reps=2, warmup=1, rounds=1)
    got = confirm.confirm(world, op, p, op.inputs(world, p, 5), [], "graph", reps=1, warmup=1, rounds=1)
    ag = registry.get("ag_gemm")
    gp = ag.sweep("cpu", world.size)[0]
    (capturable,) = measure(world, ag, gp, "bsp", {}, modes=("graph",), reps=2, warmup=1)
    return {"graph": (graph.mode, graph.ok, graph.error, graph.extra.get("timed_eager")),
            "eager": (eager.ok, eager.extra.get("timed_eager")),
            "turns": (turns[0].mode, turns[0].ok, turns[0].extra.get("timed_eager")),
            "confirm": (got.timed_eager, got.describe()),
            "capturable": (capturable.ok, capturable.extra.get("timed_eager"))}


def test_graph_mode_times_a_non_capturable_variant_eagerly():
    for r in spawn(_graph_mode_on_cpu, 2, timeout_s=600):
        assert r["graph"][:2] == ("graph", True) and r["graph"][3] is True, r["graph"]
        assert r["eager"] == (True, None), r["eager"]
        assert r["turns"] == ("graph", True, True), r["turns"]
        assert r["confirm"][0] == ["bsp"] and "timed eagerly" in r["confirm"][1], r["confirm"]
        assert r["capturable"] == (False, None), r["capturable"]  # graph mode on CPU: no graphs, not eager


def test_show_and_export_star_a_latency_timed_eagerly(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from autofuse.cli import app

    gpu = dict(environment.fingerprint(), device_kind="cuda", gpu_name="Imaginary GPU", gpu_count=2)
    gpu["id"] = environment.fingerprint_id(gpu)
    db = tmp_path / "e.db"
    p = moe.make_problem(moe.DISPATCH, "bfloat16", 2, 8, 4096, 14336, 8, 2, "swiglu")
    q = Problem.make("ag_gemm", "bfloat16", 2, M=4096, N=3584, K=8192, gather="rows")
    with Store(db) as store:
        store.add([Measurement(p, "bsp", {}, "graph", True, "", 0.0, 321.5, 321.5, 321.5, 321.5, 10,
                               {"timed_eager": True})], gpu, source="baseline")
        store.add([Measurement(q, "bsp", {}, "graph", True, "", 0.0, 123.5, 123.5, 123.5, 123.5, 10)], gpu,
                  source="baseline")
    monkeypatch.chdir(tmp_path)
    show = CliRunner().invoke(app, ["show", "--db", str(db)], env={"COLUMNS": "200"})
    assert show.exit_code == 0, show.output
    assert "321.5*" in show.stdout and "123.5*" not in show.stdout and "123.5" in show.stdout, show.stdout
    assert show.stdout.count("timed eagerly in graph mode") == 1, show.stdout
    export = CliRunner().invoke(app, ["export", "--db", str(db), "--format", "json"])
    assert export.exit_code == 0, export.output
    records = json.loads((tmp_path / "autofuse-out" / "tuning-graph.json").read_text())
    assert {r["op"]: r["timed_eager"] for r in records} == {"moe_dispatch": "bsp", "ag_gemm": ""}
