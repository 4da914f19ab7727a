"""Policy: fit on real CPU measurements (a toy op with a known crossover), JSON round trip, unsure
fallback, refusal of a foreign fingerprint or of a malformed file (validated throughout), the
held-out evaluation, the runtime's independence from scikit-learn, and the fit/export/show CLI."""
from __future__ import annotations

import copy
import json
import math
import random

import numpy as np
import pytest
from _toy_op import OP as TOY

from autofuse.core import settings
from autofuse.measure import environment
from autofuse.dispatch import policy
from autofuse.core.op import Problem
from autofuse.dispatch.policy import BSP, Policy, PolicyWarning
from autofuse.tuning import fit as fitting
from autofuse.comm.world import spawn

FP = environment.fingerprint("cpu")


def _measure_toy(world) -> list:
    """Every toy problem x (bsp, fused BLOCK 16, fused BLOCK 32), timed in eager mode on CPU ranks."""
    import torch

    from autofuse.measure.timing import measure

    torch.set_num_threads(1)  # two ranks on two cores: intra-op threads would fight the busy waits
    out = []
    for p in TOY.sweep("cpu", world.size):
        for variant, config in (("bsp", {}), ("fused", {"BLOCK": 16}), ("fused", {"BLOCK": 32})):
            out += measure(world, TOY, p, variant, config, modes=("eager",), reps=5, warmup=1, budget_s=30)
    return out if world.rank == 0 else []


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """A tuning database written through the store API from a real 2-rank CPU measurement run."""
    from autofuse.measure.store import Store

    measurements = spawn(_measure_toy, 2)[0]
    path = tmp_path_factory.mktemp("policy") / "autofuse.db"
    store = Store(path)
    store.add(measurements, FP, source="tune")
    store.close()
    return path


@pytest.fixture(scope="module")
def rows(db):
    from autofuse.measure.store import Store

    store = Store(db)
    try:
        return store.best(op="toy_mm", mode="eager", fingerprint_id=FP["id"])
    finally:
        store.close()


@pytest.fixture(scope="module")
def fitted(rows):
    return fitting.fit(rows, FP, "eager", ops={"toy_mm": TOY})


def _toy(m: int, n: int = 16, k: int = 16, world: int = 2) -> Problem:
    return Problem.make("toy_mm", "float32", world, M=m, N=n, K=k)


def _grid() -> list[Problem]:
    return [_toy(m, n, k) for m in (2, 8, 48, 100, 128, 200, 1024, 3000, 8192) for n in (8, 16, 64) for k in (16, 32)]


def test_measurements_cover_every_problem(rows):
    problems = {r["problem"] for r in rows}
    assert len(problems) == len(TOY.sweep("cpu", 2))
    variants = {(r["problem"], r["variant"]) for r in rows}
    assert all((p, "bsp") in variants for p in problems)
    # BLOCK=32 cannot run M=16: the failed config is never a candidate
    assert all(r["config"] == {"BLOCK": 16} for r in rows if r["problem"].startswith("toy_mm|K=16,M=16,") and r["variant"] == "fused")


def test_fit_report_compares_both_models(fitted):
    rep = fitted.report["ops"]["toy_mm"]
    assert rep["problems"] == len(TOY.sweep("cpu", 2)) and rep["variants"] == ["bsp", "fused"]
    assert set(rep["models"]) == {"gbr", "tree"} and rep["kept"] in ("gbr", "tree")
    assert rep["why"].startswith(f"kept {rep['kept']}:")
    for r in list(rep["models"].values()) + list(rep["baselines"].values()):
        assert r["n"] == rep["problems"]
        assert r["correct"] + r["wrong"] + r["unsure"] == r["n"]
        assert 0 <= r["within_5pct"] <= 1 and r["geomean_vs_oracle"] >= 1 - 1e-12
    assert rep["baselines"]["oracle"]["geomean_vs_oracle"] == pytest.approx(1.0)
    held = fitted.data["ops"]["toy_mm"]["evaluation"]["held_out"]
    assert held == rep["models"][rep["kept"]]
    json.dumps(fitted.data, allow_nan=False)  # plain JSON: no NaN, no objects


def test_policy_finds_the_crossover(fitted, rows):
    pol = fitted.policy
    key = _toy(1024).key
    tuned_config = next(r["config"] for r in rows if r["problem"] == key and r["variant"] == "fused")
    big = pol.decide(_toy(4096), TOY)
    assert big.variant == "fused" and big.basis == "policy" and big.config == tuned_config, big
    assert big.config_source == f"tuned on nearest problem {key}"
    small = pol.decide(_toy(2), TOY)
    assert small.variant == BSP, small
    tuned = pol.decide(_toy(1024), TOY)
    assert (tuned.variant, tuned.basis, tuned.config) == ("fused", "measured", tuned_config), tuned
    again = pol.decide(_toy(1024), TOY)
    assert (again.variant, again.config, again.reason) == (tuned.variant, tuned.config, tuned.reason)
    # a variant the caller cannot run is never chosen
    assert pol.decide(_toy(4096), TOY, available=["bsp"]).variant == BSP


def test_explain_says_each_thing_once_and_credits_no_empty_config(fitted):
    """str(decision) (what `autofuse.explain` prints): the why line names its basis once ('[unsure] ...', not
    '[unsure] unsure: ...'), and bsp's empty config is credited to no tuned problem (of another dtype or any)."""
    problems = _grid() + [Problem.make("toy_mm", "bfloat16", 2, M=m, N=16, K=16) for m in (2, 1024, 4096)]
    seen = set()
    for pol in (fitted.policy, Policy.bsp("no policy here")):
        for p in problems:
            d = pol.decide(p, TOY)
            seen.add(d.basis)
            text = str(d)
            why = next(line for line in text.splitlines() if line.lstrip().startswith("why:"))
            assert f"[{d.basis}] {d.basis}:" not in why, text
            config = next(line for line in text.splitlines() if line.lstrip().startswith("config:"))
            if not d.config:
                assert "tuned" not in config and "tuned" not in d.config_source and "no parameters" in config, text
    assert {"unsure", "fallback", "policy"} <= seen or {"fallback", "measured"} <= seen, seen


def test_json_round_trip_gives_identical_decisions(fitted, tmp_path):
    path = fitted.policy.save(tmp_path / "p.json")
    loaded = Policy.load(path, FP)
    assert not loaded.refused
    for p in _grid() + [_toy(m, 16) for m in (16, 64, 256, 1024)]:
        a, b = fitted.policy.decide(p, TOY), loaded.decide(p, TOY)
        assert (a.variant, a.config, a.reason, a.basis, a.config_source) == \
            (b.variant, b.config, b.reason, b.basis, b.config_source), p.key


def test_exported_trees_match_sklearn(rows):
    d = fitting.collect(rows, {"toy_mm": TOY})["toy_mm"]
    everything = range(len(d.keys))
    rng = random.Random(0)
    xs = d.x + [[v * rng.uniform(0.7, 1.3) for v in x] for x in d.x for _ in range(3)]
    gbr = fitting._fit_gbr(d, everything)
    for x in xs:
        for v in d.variants:
            onehot = [1.0 if u == v else 0.0 for u in d.variants]
            want = gbr["_sk"].predict(np.asarray([x + onehot]))[0]
            assert policy._gbr_log_latency(gbr, x, v) == pytest.approx(want, rel=1e-12, abs=1e-12)
    tree = fitting._fit_tree(d, everything)
    for x in xs:
        leaf = policy._walk(tree["tree"], policy._f32(x))
        assert tree["classes"][tree["tree"]["label"][leaf]] == tree["_sk"].predict(np.asarray([x]))[0]
        assert leaf == tree["_sk"].apply(np.asarray([x], dtype=np.float32))[0]


def test_unsure_falls_back_to_bsp(fitted):
    data = copy.deepcopy(fitted.data)
    data["ops"]["toy_mm"]["margin"] = 10.0  # the model's error dwarfs any predicted gain
    d = Policy(data).decide(_toy(4096), TOY)
    assert d.variant == BSP and d.basis == "unsure" and d.reason.startswith("unsure:") and d.gain > 0, d
    data["ops"]["toy_mm"]["margin"] = None  # no measured error at all: never leave BSP on a prediction
    assert Policy(data).decide(_toy(4096), TOY).basis == "unsure"
    data["ops"]["toy_mm"]["model"] = None
    assert Policy(data).decide(_toy(4096), TOY).basis == "unsure"
    # a tuned problem whose fused gain is within measurement noise stays on BSP
    data = copy.deepcopy(fitted.data)
    us = data["ops"]["toy_mm"]["problems"]["toy_mm|K=16,M=1024,N=16|float32|w2"]["us"]
    us["fused"] = us["bsp"] / 1.01
    d = Policy(data).decide(_toy(1024), TOY)
    assert d.variant == BSP and d.basis == "unsure", d


def _synthetic_rows(noise: float, gain: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for m in (16, 32, 64, 128, 256, 512, 1024, 2048):
        for n in (16, 32, 64):
            key = _toy(m, n).key
            bsp = 50.0 + m
            out.append({"problem": key, "op": "toy_mm", "variant": "bsp", "config": {}, "median_us": bsp})
            out.append({"problem": key, "op": "toy_mm", "variant": "fused", "config": {"BLOCK": 16},
                        "median_us": bsp / gain * math.exp(rng.gauss(0, noise))})
    return out


def test_a_problem_with_only_its_baseline_is_predicted_not_a_measured_bsp_win():
    """A tune cut short measured one problem's BSP and none of its candidates: the fit leaves it out of the
    measured problems (saying so) and the policy predicts it from its neighbours (fused, 1.5x everywhere),
    where taking it as measured would run bsp there."""
    rows = _synthetic_rows(noise=0.01, gain=1.5)
    cut = _toy(256, 32).key
    rows = [r for r in rows if not (r["problem"] == cut and r["variant"] != "bsp")]
    res = fitting.fit(rows, FP, "eager", ops={"toy_mm": TOY})
    assert any(s.startswith(cut) and "only bsp measured" in s for s in res.report["ops"]["toy_mm"]["skipped"])
    d = Policy(res.data).decide(Problem.from_key(cut), TOY)
    assert d.variant == "fused" and d.basis != "measured", d
    alone = fitting.collect([r for r in rows if r["variant"] == "bsp"], {"toy_mm": TOY})["toy_mm"]
    assert len(alone.keys) == 24 and not alone.skipped  # bsp alone everywhere: kept (the "only bsp" report)


def test_fit_is_unsure_where_gains_are_noise():
    """Fused and BSP equal under 5% noise: some held-out calls are unsure, and the policy costs little;
    with a clear 1.5x gain it picks fused everywhere."""
    for seed in range(3):
        res = fitting.fit(_synthetic_rows(noise=0.05, gain=1.0, seed=seed), FP, "eager", ops={"toy_mm": TOY})
        rep = res.report["ops"]["toy_mm"]["models"][res.report["ops"]["toy_mm"]["kept"]]
        assert rep["unsure"] > 0 and rep["margin"] > 0.01 and rep["speedup_vs_bsp"] > 0.97, rep
        assert [m["margin_quantile"] for m in rep["margins_tried"]] == list(fitting.MARGIN_QUANTILES)
    clear = fitting.fit(_synthetic_rows(noise=0.01, gain=1.5), FP, "eager", ops={"toy_mm": TOY})
    rep = clear.report["ops"]["toy_mm"]["models"][clear.report["ops"]["toy_mm"]["kept"]]
    assert rep["correct"] == rep["n"] and rep["picked"] == {"fused": rep["n"]}, rep


def test_foreign_fingerprint_is_refused(fitted, tmp_path):
    """Layered: other hardware refuses the policy; other software is used with every decision marked
    for confirmation; an op whose code changed loses its entries while the other ops keep theirs."""
    data = copy.deepcopy(fitted.data)
    data["fingerprint"]["gpu_name"] = "Some Other GPU"
    data["fingerprint"]["triton"] = "0.0.1"
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(data))
    with pytest.warns(PolicyWarning, match="other hardware .*gpu_name"):
        pol = Policy.load(path, FP)
    assert pol.refused
    d = pol.decide(_toy(4096), TOY)
    variant, config, reason = d.variant, d.config, d.reason
    assert variant == BSP and config == {} and reason.startswith("fallback:") and "gpu_name" in reason
    newer = copy.deepcopy(fitted.data)
    newer["fingerprint"]["triton"] = "0.0.1"
    with pytest.warns(PolicyWarning, match="other software .*triton 0.0.1 there.*confirmed"):
        pol = Policy.from_dict(newer, FP)
    assert not pol.refused and pol.software == {"triton": ("0.0.1", FP["triton"])}
    assert pol.decide(_toy(4096), TOY).variant == "fused"
    stale = copy.deepcopy(fitted.data)
    stale["fingerprint"]["ops"] = {**FP.get("ops", {}), "toy_mm": "0" * 16}
    pol = Policy.from_dict(stale, FP)
    d = pol.decide(_toy(4096), TOY)
    assert not pol.refused and "toy_mm" in pol.stale_ops and "toy_mm" in pol.ops
    assert d.variant == "fused" and d.reason.startswith("stale: toy_mm's code changed"), d
    assert pol.needs_confirmation(_toy(4096), d)  # a stale entry is a prediction, never trusted as measured
    bad = copy.deepcopy(fitted.data)
    bad["format_version"] = 99
    with pytest.warns(PolicyWarning, match="format version"):
        assert Policy.from_dict(bad, FP).refused
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.warns(PolicyWarning, match="cannot read"):
        assert Policy.load(tmp_path / "junk.json", FP).decide(_toy(8), TOY).variant == BSP


def test_evaluate_counts():
    us = {"a": {"bsp": 100.0, "f": 50.0}, "b": {"bsp": 100.0, "f": 99.0}, "c": {"bsp": 100.0, "f": 200.0},
          "d": {"bsp": 100.0, "f": 80.0}}
    decisions = {"a": ("f", "policy"), "b": ("bsp", "unsure"), "c": ("f", "policy"), "d": ("bsp", "unsure")}
    r = fitting.evaluate(decisions, us)
    assert (r["correct"], r["wrong"], r["unsure"], r["unsure_ok"]) == (1, 1, 2, 1)
    assert r["within_5pct"] == pytest.approx(0.5)
    assert r["worst_vs_bsp"] == pytest.approx(2.0) and r["worst_problem"] == "c"
    assert r["geomean_vs_bsp"] == pytest.approx((0.5 * 1 * 2 * 1) ** 0.25)
    assert r["geomean_vs_oracle"] == pytest.approx((1 * (100 / 99) * 2 * (100 / 80)) ** 0.25)


def test_cli_fit_export_show(db, tmp_path):
    from typer.testing import CliRunner

    from autofuse.cli import app

    runner = CliRunner()
    out = tmp_path / "models" / "toy.json"
    res = runner.invoke(app, ["fit", "--db", str(db), "--mode", "eager", "--out", str(out),
                              "--report", str(tmp_path / "report.json")])
    assert res.exit_code == 0, res.output
    assert "kept" in res.output and out.exists()
    data = json.loads(out.read_text())
    assert data["format"] == "autofuse-policy" and data["fingerprint"]["id"] == FP["id"] and data["mode"] == "eager"
    assert json.loads((tmp_path / "report.json").read_text())["ops"]["toy_mm"]["kept"] in ("gbr", "tree")
    res = runner.invoke(app, ["fit", "--db", str(db), "--mode", "eager", "--out", str(out), "--json"])
    assert res.exit_code == 1 and "exists; pass --force" in res.output, res.output  # never replaced silently
    res = runner.invoke(app, ["fit", "--db", str(db), "--out", str(out), "--json", "--force"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ops"]["toy_mm"]["problems"] == 14, res.output
    assert "--mode not given: reading the eager mode" in res.stderr
    for fmt in ("csv", "json"):
        target = tmp_path / f"table.{fmt}"
        res = runner.invoke(app, ["export", "--format", fmt, "--db", str(db), "--mode", "eager", "--out", str(target)])
        assert res.exit_code == 0, res.output
    table = json.loads((tmp_path / "table.json").read_text())
    assert len(table) == 14
    row = next(r for r in table if r["M"] == 1024 and r["N"] == 16)
    assert row["variant"] == "fused" and row["config"]["BLOCK"] in (16, 32) and row["latency_us"] < row["bsp_us"]
    assert row["speedup_vs_bsp"] is None and row["timing"] == "cpu-interpreter"  # CPU timings: never a speedup
    assert (tmp_path / "table.csv").read_text().splitlines()[0].startswith("op,problem,dtype,world")
    res = runner.invoke(app, ["show", "--db", str(db), "--mode", "eager"])
    assert res.exit_code == 0 and "toy_mm" in res.output, res.output
    res = runner.invoke(app, ["show", "--db", str(db), "--mode", "eager", "--plot", str(tmp_path / "p.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res.exit_code == 1 and "needs matplotlib" in res.output
    else:
        assert res.exit_code == 0 and (tmp_path / "p.png").stat().st_size > 0, res.output
    res = runner.invoke(app, ["fit", "--db", str(tmp_path / "missing.db"), "--mode", "eager"])
    assert res.exit_code == 1 and "no tuning database" in res.output


def test_bound_rows_are_shown_never_chosen():
    from autofuse.bench.tables import problem_table

    rows = _synthetic_rows(noise=0.01, gain=1.5)
    keys = sorted({r["problem"] for r in rows})
    rows += [{"problem": keys[0], "op": "toy_mm", "variant": "bound", "config": {}, "median_us": 1.0},
             {"problem": keys[1], "op": "toy_mm", "variant": "bound.allgather", "config": {}, "median_us": 2.0},
             {"problem": keys[1], "op": "toy_mm", "variant": "bound.matmul", "config": {}, "median_us": 3.0}]
    table = {e["problem"]: e for e in problem_table(rows)}
    assert table[keys[0]]["bound_us"] == 1.0 and table[keys[1]]["bound_us"] == 3.0
    assert table[keys[2]]["bound_us"] is None
    assert all(e["best"] == "fused" for e in table.values())
    res = fitting.fit(rows, FP, "eager", ops={"toy_mm": TOY})
    assert res.data["ops"]["toy_mm"]["variants"] == ["bsp", "fused"]


def test_constant_feature_does_not_swamp_nearest_problem_distance():
    """A feature constant over the tuned problems (std = rounding noise) gets scale 1, not ~1e-20."""
    import numpy as np

    from autofuse.tuning.fit import feature_scale

    log_n = np.log2(3584.0)
    cols = np.array([[3.0, log_n + 1e-16 * i, 13.0] for i in range(4)]) + np.array([[i, 0, 0] for i in range(4)])
    scale = feature_scale(cols, 3)
    assert scale[0] == pytest.approx(np.std([3, 4, 5, 6]))
    assert scale[1] == 1.0 and scale[2] == 1.0
    assert feature_scale(np.zeros((0, 2)), 2) == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# Malformed policy files: one warning naming the file and the first problem, then BSP for every op


@pytest.fixture(scope="module")
def clean():
    """A valid policy (synthetic rows, no ranks) in both model kinds: {"gbr": data, "tree": data}."""
    rows = _synthetic_rows(noise=0.01, gain=1.5)
    for r in rows:  # a crossover: fused wins only from M = 256 on, so both models have internal nodes
        if r["variant"] == "fused" and Problem.from_key(r["problem"])["M"] < 256:
            r["median_us"] *= 2.5
    res = fitting.fit(rows, FP, "eager", ops={"toy_mm": TOY})
    d = fitting.collect(rows, {"toy_mm": TOY})["toy_mm"]
    out = {}
    for kind, fitter in (("gbr", fitting._fit_gbr), ("tree", fitting._fit_tree)):
        data = copy.deepcopy(res.data)
        model = fitter(d, range(len(d.keys)))
        model.pop("_sk")
        data["ops"]["toy_mm"]["model"] = model
        assert policy.validate(data) is None
        assert any(left != -1 for left in (model["tree"] if kind == "tree" else model["trees"][0])["left"])
        out[kind] = data
    return out


def _leaf_of(tree: dict) -> int:
    return next(i for i, left in enumerate(tree["left"]) if left == -1)


def _op(d: dict) -> dict:
    return d["ops"]["toy_mm"]


def _tree(d: dict) -> dict:
    """The decision tree of a 'tree' model."""
    return _op(d)["model"]["tree"]


def _gbr(d: dict, i: int) -> dict:
    """Tree i of a 'gbr' model."""
    return _op(d)["model"]["trees"][i]


def _share_child(d: dict) -> None:
    t = _gbr(d, 3)
    t["right"][0] = t["left"][0]  # both children of the root are the same node


MALFORMED = {
    # name: (model kind, mutation, text the warning must contain)
    "shared node": ("gbr", _share_child, "reached twice"),
    "missing nested key": ("gbr", lambda d: _gbr(d, 5).pop("threshold"), "lacks 'threshold'"),
    "missing candidate config": ("tree", lambda d: _op(d)["candidates"]["fused"][0].pop("config"), "lacks 'config'"),
    "feature index out of range": ("tree", lambda d: _tree(d)["feature"].__setitem__(0, 99),
                                   "feature index 99 out of range"),
    "child index out of range": ("gbr", lambda d: _gbr(d, 0)["left"].__setitem__(0, 10**6), "child index out of range"),
    "zero scale": ("gbr", lambda d: _op(d)["scale"].__setitem__(0, 0.0), "must be positive"),
    "negative scale": ("tree", lambda d: _op(d)["scale"].__setitem__(1, -1.0), "must be positive"),
    "NaN threshold": ("tree", lambda d: _tree(d)["threshold"].__setitem__(0, math.nan),
                      "threshold[0]: nan is not a finite number"),
    "NaN margin": ("gbr", lambda d: _op(d).__setitem__("margin", math.nan), "margin: nan is not a finite"),
    "infinite leaf value": ("gbr", lambda d: _gbr(d, 2)["value"].__setitem__(_leaf_of(_gbr(d, 2)), math.inf),
                            "is not a finite number"),
    "NaN leaf gain": ("tree", lambda d: _op(d)["model"]["leaf_gain"].__setitem__(
        _leaf_of(_tree(d)), {"bsp": 0.0, "fused": math.nan}), "leaf_gain"),
    "label out of range": ("tree", lambda d: _tree(d)["label"].__setitem__(0, 7), "is not a class index"),
    "leaf with one child": ("tree", lambda d: _tree(d)["right"].__setitem__(_leaf_of(_tree(d)), 1), "has one child"),
    "huge integer": ("gbr", lambda d: _op(d)["model"].__setitem__("init", 10**400), "not a finite number"),
    "features not strings": ("gbr", lambda d: _op(d)["features"].__setitem__(0, [[["x"]]]), "is not a string"),
    "unknown problem in candidates": ("tree", lambda d: _op(d)["candidates"]["bsp"][0]["problems"].append(
        "toy_mm|K=1|float32|w2"), "which the policy does not hold"),
    "nested fingerprint": ("gbr", lambda d: d["fingerprint"].__setitem__("ops", {"toy_mm": {"deeper": 1}}),
                           "fingerprint['ops']['toy_mm']"),
    "zero latency": ("gbr", lambda d: next(iter(_op(d)["problems"].values()))["us"].__setitem__("bsp", 0.0),
                     "must be positive"),
}


def _refused_once(path, must_contain: str) -> Policy:
    """Load `path`: exactly one PolicyWarning naming it and the problem; every op then runs BSP."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pol = Policy.load(path, FP)
    msgs = [str(w.message) for w in caught if issubclass(w.category, PolicyWarning)]
    assert len(msgs) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert str(path) in msgs[0] and must_contain in msgs[0], msgs[0]
    assert pol.refused
    for p in (_toy(4096), _toy(2)):
        d = pol.decide(p, TOY)
        assert d.variant == BSP and d.basis == "fallback", d
    return pol


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_policy_is_refused_with_one_warning(clean, tmp_path, case):
    kind, mutate, text = MALFORMED[case]
    data = copy.deepcopy(clean[kind])
    mutate(data)
    path = tmp_path / f"{case.replace(' ', '_')}.json"
    path.write_text(json.dumps(data))  # json writes NaN / Infinity tokens, which json.loads accepts
    _refused_once(path, text)


def test_cycle_in_a_tree_is_refused_not_walked(clean, tmp_path):
    """A node that is its own child would make the walk loop forever: refused at load."""
    data = copy.deepcopy(clean["tree"])
    t = data["ops"]["toy_mm"]["model"]["tree"]
    child = t["left"][0]
    assert child != -1
    t["left"][child], t["right"][child], t["feature"][child] = child, t["right"][0], 0
    assert policy.validate(copy.deepcopy(clean["tree"])) is None
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(data))
    _refused_once(path, "reached twice from the root (a cycle or a shared node)")


def test_deeply_nested_and_oversized_json_are_refused(tmp_path, monkeypatch):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    _refused_once(deep, "nested too deeply")
    nested = tmp_path / "nested.json"  # deep inside a valid-looking structure
    nested.write_text('{"format": "autofuse-policy", "format_version": 1, "fingerprint": {"id": "x"}, "ops": '
                      + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}")
    _refused_once(nested, str(nested))
    monkeypatch.setattr(policy, "MAX_FILE_BYTES", 100)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * 200}))
    _refused_once(big, "larger than")


def test_files_that_never_end_are_refused_without_reading_them(tmp_path):
    """A FIFO (no writer: opening it would block), a link to /dev/zero (it never ends), a device, a folder, a
    200 MB file (sparse: it claims the size) and a growing file are refused before or while reading at most
    MAX_FILE_BYTES + 1 bytes; a policy larger than that is never written by fit (to_json refuses it)."""
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused_once(fifo, "not a regular file")
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    _refused_once(zero, "not a regular file")
    _refused_once(tmp_path, "not a regular file")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(200 << 20)
    _refused_once(huge, "larger than")
    with pytest.raises(ValueError, match="larger than"):
        Policy({"pad": "x" * (policy.MAX_FILE_BYTES + 1)}).to_json()


def _fifo_policy_job(world, fifo: str):
    """The first call of a public op with AUTOFUSE_POLICY naming a FIFO: returns (basis, reason, correct)."""
    import os
    import warnings

    import torch

    import autofuse
    from autofuse import dispatch

    os.environ["AUTOFUSE_POLICY"] = fifo
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = autofuse.gemm_ar(a, b)
    whole = [torch.empty_like(a @ b) for _ in range(world.size)]
    torch.distributed.all_gather(whole, a @ b)
    choice = dispatch.explain("gemm_ar", a, b)
    return choice.basis, choice.reason, bool(torch.allclose(out, sum(whole), atol=1e-4))


def test_a_fifo_as_policy_runs_bsp_on_every_rank(tmp_path):
    """AUTOFUSE_POLICY naming a FIFO (nobody writes it) blocked every rank's first call forever: now every
    rank refuses it (one warning) and runs BSP, correctly."""
    import os

    fifo = tmp_path / "policy.json"
    os.mkfifo(fifo)
    for basis, reason, correct in spawn(_fifo_policy_job, 2, str(fifo), device_kind="cpu", timeout_s=300):
        assert basis == "fallback" and "not a regular file" in reason and correct, (basis, reason)


def test_valid_policies_pass_validation(clean):
    """Both model kinds fitted here, and the shipped policies, are accepted as they are."""
    from pathlib import Path

    for data in clean.values():
        assert policy.validate(data) is None
        with_digests = dict(data, fingerprint=dict(data["fingerprint"], ops={"toy_mm": "0123abcd"}))
        assert policy.validate(with_digests) is None  # one level of nesting: per-op code digests
    shipped = sorted((Path(__file__).resolve().parents[1] / "models").glob("*.json"))
    assert shipped
    for path in shipped:
        data, why = policy.read_file(path)
        assert not why and policy.validate(data) is None, path


def test_runtime_policy_never_imports_sklearn(clean, tmp_path):
    """Loading and deciding runs without scikit-learn (and policy.py imports neither it nor numpy)."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "p.json"
    Policy(clean["gbr"]).save(path)
    code = ("import sys, autofuse.dispatch.policy as p; from autofuse.core.op import Problem; "
            f"sys.path.insert(0, {str(Path(__file__).parent)!r}); from _toy_op import OP; "
            f"pol = p.Policy.load({str(path)!r}); assert not pol.refused, pol.refused; "
            "d = pol.decide(Problem.make('toy_mm', 'float32', 2, M=4096, N=16, K=16), OP); "
            "print(d.variant, d.basis); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sklearn', 'optuna', 'scipy')]; "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    source = (Path(policy.__file__)).read_text()
    assert "import numpy" not in source and "sklearn" not in source.replace("scikit-learn", "")


def test_policy_file_names():
    cpu = environment.fingerprint("cpu")
    name = policy.file_name(cpu, "eager")
    assert name.startswith("cpu-emulation-") and "-x0-" not in name and name.endswith(f"{cpu['id']}-eager.json")
    gpu = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "id": "abc", "device_kind": "cuda"}
    assert policy.file_name(gpu, "graph") == "nvidia-h200-x2-abc-graph.json"


def test_user_models_dir(monkeypatch, tmp_path):
    from pathlib import Path

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert settings.user_models_dir() == tmp_path / "autofuse" / "models"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # the XDG spec: relative paths are ignored
    assert settings.user_models_dir() == Path.home() / ".local" / "share" / "autofuse" / "models"


def test_a_picked_variant_that_cannot_run_the_problem_gives_way_to_the_next(clean, monkeypatch):
    """The model's pick has no config accepting the problem (as torch's all-reduce refuses float16): the
    next variant by predicted gain is chosen (and confirmed on first use), not BSP by default."""
    data = copy.deepcopy(clean["tree"])
    op = _op(data)
    model = op["model"]
    op["variants"] = sorted(set(op["variants"]) | {"gpu_only"})
    if "gpu_only" not in model["classes"]:
        model["classes"].append("gpu_only")
    tree = model["tree"]
    for node, left in enumerate(tree["left"]):
        if left == -1:
            tree["label"][node] = model["classes"].index("gpu_only")
            model["leaf_gain"][node] = {"bsp": 0.0, "fused": 1.0, "gpu_only": 2.0}
    op["margin"] = 0.01
    d = Policy(data).decide(_toy(4096), TOY)
    assert d.variant == "gpu_only", d  # runnable: the model's pick stands
    monkeypatch.setattr(type(TOY.variant("gpu_only")), "check", lambda self, problem, config: "cannot run it")
    d = Policy(data).decide(_toy(4096), TOY)
    assert d.variant == "fused" and d.basis == "policy", d
    assert Policy(data).needs_confirmation(_toy(4096), d)
