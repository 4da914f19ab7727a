"""Fitting the dispatch policy on the tuning store (scikit-learn; training side, never imported at run time).

Fitted on the store's best measurement per (problem, variant). Two scikit-learn models are
compared on problems held out of training (k folds by problem) and the better is kept:

- `gbr`: a gradient-boosted regressor of log latency from the problem's features plus a one-hot
  of the variant; the predicted gain of variant v over BSP is pred(bsp) - pred(v).
- `tree`: a decision-tree classifier of the fastest variant; each leaf also carries the mean
  measured log gain over BSP of every variant among the training problems that reach it.

The unsure margin is a quantile of |predicted - measured| log gain on held-out problems: the
largest of the 50/75/90th percentiles whose held-out geomean latency is within 0.5% of the best of
them (safety first). The result is plain JSON (`autofuse.dispatch.policy` reads and validates it at run time:
the trees as arrays (left, right, feature, threshold, value), the feature names and scales, the
measured problems with their best configs, the error and the held-out evaluation, and the
environment fingerprint).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from autofuse import __version__
from autofuse.core.features import problem_features, vector
from autofuse.core import registry
from autofuse.core.op import Config, Op, Problem, config_key
from autofuse.dispatch.policy import BSP, FORMAT, FORMAT_VERSION, Policy, predict, validate

WITHIN = 0.05  # "within 5% of the best measured candidate"
MARGIN_QUANTILES = (0.5, 0.75, 0.9)  # candidate unsure margins: quantiles of the held-out error
SAFETY_COST = 0.005  # a larger margin (more BSP) is kept while it costs at most 0.5% geomean latency
MODELS = ("gbr", "tree")


class FitError(RuntimeError):
    """A fitted policy failed the loader's validation (a bug: it would be refused at run time)."""


@dataclass
class OpData:
    """One op's measurements, per problem: features and the best latency and config per variant."""

    op: str
    keys: list[str] = field(default_factory=list)
    x: list[list[float]] = field(default_factory=list)
    us: dict[str, dict[str, float]] = field(default_factory=dict)
    configs: dict[str, dict[str, Config]] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def collect(rows: Iterable[Mapping[str, Any]], ops: Mapping[str, Op] | None = None) -> dict[str, OpData]:
    """Group store rows (store.best) by op; drop 'bound*' rows, problems without a BSP row and, where other
    problems of the op have candidates measured, problems with nothing but their BSP row (a tune cut short:
    as a measured problem its table entry would say bsp wins there, which nothing measured)."""
    ops = dict(ops or {})
    best: dict[str, dict[str, dict[str, tuple[float, Config]]]] = {}
    for row in rows:
        variant = row["variant"]
        t = float(row["median_us"])
        if variant.startswith("bound") or not math.isfinite(t) or t <= 0:
            continue
        config = json.loads(row["config"]) if isinstance(row["config"], str) else dict(row["config"])
        per = best.setdefault(row["op"], {}).setdefault(row["problem"], {})
        if variant not in per or t < per[variant][0]:
            per[variant] = (t, config)
    out: dict[str, OpData] = {}
    for name, problems in sorted(best.items()):
        d = OpData(name)
        # An op this installation does not register (e.g. one defined in a user's module and tuned
        # with `--op module:attr` without passing it here) is fitted on the generic features only.
        op = ops.get(name) or (registry.get(name) if name in registry.MODULES else None)
        feats: dict[str, dict[str, float]] = {}
        for key in sorted(problems):
            per = problems[key]
            if BSP not in per:
                d.skipped.append(f"{key}: no bsp measurement")
                continue
            feats[key] = problem_features(Problem.from_key(key), op)
            d.keys.append(key)
            d.us[key] = {v: t for v, (t, _) in per.items()}
            d.configs[key] = {v: c for v, (_, c) in per.items()}
        if any(len(d.us[k]) > 1 for k in d.keys):  # a problem a cut-short tune left with its baseline alone is
            for key in [k for k in d.keys if len(d.us[k]) == 1]:  # no evidence that bsp wins there: predicted
                d.skipped.append(f"{key}: only bsp measured (the tune stopped before its candidates): predicted "
                                 "like a problem no tune measured")
                d.keys.remove(key)
                del d.us[key], d.configs[key], feats[key]
        d.features = sorted({f for fs in feats.values() for f in fs})
        d.x = [vector(feats[k], d.features) for k in d.keys]
        d.variants = [BSP] + sorted({v for k in d.keys for v in d.us[k]} - {BSP})
        out[name] = d
    return out


def _gain(us: Mapping[str, float], variant: str) -> float:
    return math.log(us[BSP] / us[variant])


def _fit_gbr(d: OpData, rows: Sequence[int], seed: int = 0) -> dict[str, Any]:
    from sklearn.ensemble import GradientBoostingRegressor

    X, y = [], []
    for i in rows:
        for v, t in d.us[d.keys[i]].items():
            X.append(d.x[i] + [1.0 if u == v else 0.0 for u in d.variants])
            y.append(math.log(t))
    m = GradientBoostingRegressor(n_estimators=200, learning_rate=0.05, max_depth=3, random_state=seed)
    m.fit(np.asarray(X), np.asarray(y))
    trees = []
    for est in m.estimators_[:, 0]:
        t = est.tree_
        trees.append({"left": t.children_left.tolist(), "right": t.children_right.tolist(),
                      "feature": t.feature.tolist(), "threshold": t.threshold.tolist(),
                      "value": t.value[:, 0, 0].tolist()})
    return {"kind": "gbr", "variants": list(d.variants), "init": float(m.init_.constant_[0][0]),
            "learning_rate": float(m.learning_rate), "trees": trees, "_sk": m}


def _fit_tree(d: OpData, rows: Sequence[int], seed: int = 0) -> dict[str, Any]:
    from sklearn.tree import DecisionTreeClassifier

    X = np.asarray([d.x[i] for i in rows])
    labels = [min(sorted(d.us[d.keys[i]]), key=lambda v, u=d.us[d.keys[i]]: (u[v], v != BSP)) for i in rows]
    m = DecisionTreeClassifier(max_depth=6, min_samples_leaf=2 if len(rows) >= 8 else 1, random_state=seed)
    m.fit(X, labels)
    t = m.tree_
    sums: dict[int, dict[str, list[float]]] = {}
    for i, leaf in zip(rows, m.apply(X.astype(np.float32))):
        us = d.us[d.keys[i]]
        for v in us:
            sums.setdefault(int(leaf), {}).setdefault(v, []).append(_gain(us, v))
    leaf_gain = [{v: statistics.fmean(g) for v, g in sorted(sums[n].items())} if n in sums else None
                 for n in range(t.node_count)]
    tree = {"left": t.children_left.tolist(), "right": t.children_right.tolist(), "feature": t.feature.tolist(),
            "threshold": t.threshold.tolist(), "label": np.argmax(t.value[:, 0, :], axis=1).tolist()}
    return {"kind": "tree", "classes": [str(c) for c in m.classes_], "tree": tree, "leaf_gain": leaf_gain, "_sk": m}


FITTERS = {"gbr": _fit_gbr, "tree": _fit_tree}


def _folds(keys: Sequence[str], k: int) -> list[int]:
    """Fold of each problem: problems sorted by a hash of their key, dealt round-robin (deterministic)."""
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).hexdigest())
    fold = [0] * len(keys)
    for rank, i in enumerate(order):
        fold[i] = rank % k
    return fold


def _choice(best: str, gain: float, margin: float) -> tuple[str, str]:
    if best == BSP:
        return BSP, "policy"
    return (best, "policy") if gain > margin else (BSP, "unsure")


def evaluate(decisions: Mapping[str, tuple[str, str]], us: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Held-out quality of decisions {problem: (variant, kind)} against measured latencies.

    Share of calls within 5% of the best measured candidate, geomean latency vs that oracle and vs
    BSP, the worst case vs BSP, and counts: correct (a model pick within 5% of the best), wrong,
    unsure (BSP for lack of confidence; `unsure_ok` of them had BSP within 5% of the best).
    """
    n = len(decisions)
    if n == 0:
        return {"n": 0}
    vs_oracle, vs_bsp = [], []
    counts = {"correct": 0, "wrong": 0, "unsure": 0, "unsure_ok": 0}
    within = 0
    picked: dict[str, int] = {}
    worst, worst_key = -math.inf, ""
    for key, (variant, kind) in sorted(decisions.items()):
        t = us[key][variant]
        oracle = min(us[key].values())
        close = t <= oracle * (1 + WITHIN)
        within += close
        vs_oracle.append(t / oracle)
        vs_bsp.append(t / us[key][BSP])
        if vs_bsp[-1] > worst:
            worst, worst_key = vs_bsp[-1], key
        if kind == "unsure":
            counts["unsure"] += 1
            counts["unsure_ok"] += close
        else:
            counts["correct" if close else "wrong"] += 1
        picked[variant] = picked.get(variant, 0) + 1
    geo = lambda xs: math.exp(statistics.fmean(math.log(v) for v in xs))  # noqa: E731
    return {"n": n, "within_5pct": within / n, "geomean_vs_oracle": geo(vs_oracle), "geomean_vs_bsp": geo(vs_bsp),
            "speedup_vs_bsp": 1 / geo(vs_bsp), "worst_vs_bsp": worst, "worst_problem": worst_key, **counts,
            "picked": dict(sorted(picked.items()))}


def _cross_validate(d: OpData, name: str, k: int) -> dict[str, Any]:
    """Held-out predictions of model `name` (k folds by problem), its measured error and evaluation."""
    fold = _folds(d.keys, k)
    preds: dict[str, tuple[str, float]] = {}
    errors: list[float] = []
    for f in range(k):
        train = [i for i in range(len(d.keys)) if fold[i] != f]
        model = FITTERS[name](d, train)
        for i in (i for i in range(len(d.keys)) if fold[i] == f):
            us = d.us[d.keys[i]]
            best, gain, gains = predict(model, d.x[i], us)
            preds[d.keys[i]] = (best, gain)
            errors += [abs(g - _gain(us, v)) for v, g in gains.items() if v != BSP and v in us]
    tried = []
    for q in MARGIN_QUANTILES if errors else (1.0,):
        margin = float(np.quantile(errors, q)) if errors else math.inf
        r = evaluate({key: _choice(best, gain, margin) for key, (best, gain) in preds.items()}, d.us)
        r.update(margin=margin if math.isfinite(margin) else None, margin_quantile=q)
        tried.append(r)
    # the largest margin (the safest: most BSP) whose geomean latency is within SAFETY_COST of the best
    top = min(r["geomean_vs_oracle"] for r in tried)
    report = max((r for r in tried if r["geomean_vs_oracle"] <= top * (1 + SAFETY_COST)),
                 key=lambda r: r["margin_quantile"])
    report = dict(report, margins_tried=[{k: r[k] for k in ("margin_quantile", "margin", "geomean_vs_oracle",
                                                             "worst_vs_bsp", "unsure")} for r in tried])
    report["error"] = {"median_abs_log_gain": statistics.median(errors) if errors else None,
                       "p90_abs_log_gain": float(np.quantile(errors, 0.9)) if errors else None,
                       "pairs": len(errors)}
    return report


def _better(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Is held-out result `a` better than `b`: geomean vs oracle, then share within 5%, then worst case."""
    ka = (round(a["geomean_vs_oracle"], 9), -round(a["within_5pct"], 9), round(a["worst_vs_bsp"], 9))
    kb = (round(b["geomean_vs_oracle"], 9), -round(b["within_5pct"], 9), round(b["worst_vs_bsp"], 9))
    return ka < kb


def _why(kept: str, other: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    a, b = results[kept], results[other]
    return (f"kept {kept}: on held-out problems its latency is {a['geomean_vs_oracle']:.3f}x the oracle's "
            f"(geomean) vs {b['geomean_vs_oracle']:.3f}x for {other}; within 5% of the best on "
            f"{a['within_5pct']:.0%} vs {b['within_5pct']:.0%}; worst case vs bsp {a['worst_vs_bsp']:.3f}x vs "
            f"{b['worst_vs_bsp']:.3f}x")


@dataclass
class FitResult:
    """What `fit` returns: the policy's JSON data, the report, and the fitted scikit-learn models."""

    data: dict[str, Any]
    report: dict[str, Any]
    sklearn: dict[str, Any]

    @property
    def policy(self) -> Policy:
        return Policy(self.data, "<fit>")


def feature_scale(cols: np.ndarray, n: int) -> list[float]:
    """Per-feature spread of the tuned problems, for nearest-problem distances.

    A feature that is constant over the tuned problems (its std is rounding noise, e.g. 1e-20 on
    log N when every tuned problem has the same N) gets scale 1: it then adds the same amount to
    every distance instead of swamping them, so the nearest problem is decided by the others.
    """
    if not len(cols):
        return [1.0] * n
    std, mag = cols.std(axis=0), np.abs(cols).mean(axis=0)
    return [float(s) if s > 1e-9 * max(1.0, float(m)) else 1.0 for s, m in zip(std, mag)]


def fit(rows: Iterable[Mapping[str, Any]], fingerprint: Mapping[str, Any], mode: str,
        ops: Mapping[str, Op] | None = None, folds: int = 5) -> FitResult:
    """Fit a policy on store rows (one per (problem, variant): the best measurement) of one mode.

    For every op: cross-validate both models by problem, keep the better (reason in the report),
    refit it on every problem, and export it with the measured error as the unsure margin.
    """
    report: dict[str, Any] = {"mode": mode, "fingerprint": fingerprint.get("id"), "ops": {}}
    out_ops: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for name, d in collect(rows, ops).items():
        rep: dict[str, Any] = {"problems": len(d.keys), "variants": d.variants, "skipped": d.skipped}
        model, margin, evaluation = None, None, {}
        fused = [v for v in d.variants if v != BSP]
        if len(d.keys) < 3 or not fused:
            rep["why"] = (f"no model: {len(d.keys)} tuned problems" if fused else "no model: only bsp was measured") + \
                "; tuned problems use their measured best, others run bsp"
        else:
            k = min(folds, len(d.keys))
            results = {m: _cross_validate(d, m, k) for m in MODELS}
            bsp_only = evaluate({key: (BSP, "policy") for key in d.keys}, d.us)
            oracle = evaluate({key: (min(sorted(u), key=lambda v, u=u: u[v]), "policy") for key, u in d.us.items()}, d.us)
            kept = "gbr" if not _better(results["tree"], results["gbr"]) else "tree"
            other = "tree" if kept == "gbr" else "gbr"
            rep.update(folds=k, models=results, baselines={"bsp": bsp_only, "oracle": oracle}, kept=kept,
                       why=_why(kept, other, results))
            model = FITTERS[kept](d, range(len(d.keys)))
            models[name] = model.pop("_sk")
            margin = results[kept]["margin"]
            evaluation = {"held_out": results[kept], "folds": k, "model": kept}
        candidates: dict[str, list[dict[str, Any]]] = {}
        for v in d.variants:
            groups: dict[str, dict[str, Any]] = {}
            for key in d.keys:
                if v in d.configs[key]:
                    c = d.configs[key][v]
                    groups.setdefault(config_key(c), {"config": c, "problems": []})["problems"].append(key)
            candidates[v] = list(groups.values())
        cols = np.asarray(d.x, dtype=np.float64) if d.x else np.zeros((0, len(d.features)))
        scale = feature_scale(cols, len(d.features))
        out_ops[name] = {
            "features": d.features, "variants": d.variants, "scale": scale, "model": model, "margin": margin,
            "problems": {key: {"x": x, "us": d.us[key]} for key, x in zip(d.keys, d.x)},
            "candidates": candidates, "evaluation": evaluation,
        }
        report["ops"][name] = rep
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "autofuse_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "fingerprint": dict(fingerprint), "ops": out_ops, "report": report}
    problem = validate(data)
    if problem:
        raise FitError(f"the fitted policy would be refused when loaded: {problem}")
    return FitResult(data, report, models)
