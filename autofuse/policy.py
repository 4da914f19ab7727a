"""Dispatch policy: which variant and config to run for a problem (DESIGN.md, Policy and dispatch).

Fitted on the tuning store's best measurement per (problem, variant). Two scikit-learn models are
compared on problems held out of training (k folds by problem) and the better is kept:

- `gbr`: a gradient-boosted regressor of log latency from the problem's features plus a one-hot
  of the variant; the predicted gain of variant v over BSP is pred(bsp) - pred(v).
- `tree`: a decision-tree classifier of the fastest variant; each leaf also carries the mean
  measured log gain over BSP of every variant among the training problems that reach it.

Either way a decision has a predicted gain over BSP; where that gain is within the model's measured
error the policy says "unsure" and runs BSP, as PyTorch's AutoHeuristic does. The error is a
quantile of |predicted - measured| log gain on held-out problems: the largest of the 50/75/90th
percentiles whose held-out geomean latency is within 0.5% of the best of them (safety first). A problem that was tuned itself uses its measured best
(BSP unless the gain beats `MEASURED_MARGIN`). The config of the chosen variant is the one tuned
on the nearest measured problem (standardised feature distance) that the variant accepts.

The fitted policy is plain JSON: the trees as arrays (left, right, feature, threshold, value) that
`_walk` follows in Python, the feature names, the measured problems with their best configs, the
error and the held-out evaluation, and the environment fingerprint. Loading runs no code; a policy
whose fingerprint differs from this machine's is refused with a warning and BSP runs instead.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from autofuse import __version__, environment
from autofuse.features import problem_features, vector
from autofuse.op import Config, Op, Problem

FORMAT = "autofuse-policy"
FORMAT_VERSION = 1
BSP = "bsp"
MEASURED_MARGIN = 0.02  # a tuned problem leaves BSP only for a measured gain above 2% (timing noise)
WITHIN = 0.05  # "within 5% of the best measured candidate"
MARGIN_QUANTILES = (0.5, 0.75, 0.9)  # candidate unsure margins: quantiles of the held-out error
SAFETY_COST = 0.005  # a larger margin (more BSP) is kept while it costs at most 0.5% geomean latency
MODELS = ("gbr", "tree")


class PolicyWarning(UserWarning):
    """A policy was refused (other hardware or versions, unreadable): BSP runs instead."""


@dataclass
class Decision:
    """What a policy chose for one problem and why.

    kind: 'measured' (the problem was tuned), 'policy' (the model's pick), 'unsure' (predicted gain
    within the model's error, so BSP), 'fallback' (no usable policy or model, so BSP).
    """

    variant: str
    config: Config
    reason: str
    kind: str
    gain: float | None = None
    config_source: str = ""


# ---------------------------------------------------------------------------------------------
# Walking exported trees (plain Python, what a loaded policy runs)


def _f32(x: Sequence[float]) -> list[float]:
    """Features as float32, exactly as scikit-learn's trees compare them against thresholds."""
    return np.asarray(x, dtype=np.float32).tolist()


def _walk(tree: Mapping[str, list], x: Sequence[float]) -> int:
    """Index of the leaf `x` reaches: go left where x[feature] <= threshold."""
    left, right, feature, threshold = tree["left"], tree["right"], tree["feature"], tree["threshold"]
    node = 0
    while left[node] != -1:
        node = left[node] if x[feature[node]] <= threshold[node] else right[node]
    return node


def _gbr_log_latency(model: Mapping[str, Any], x: Sequence[float], variant: str) -> float:
    onehot = [1.0 if v == variant else 0.0 for v in model["variants"]]
    xv = _f32(list(x) + onehot)
    raw = model["init"]
    for tree in model["trees"]:
        raw += model["learning_rate"] * tree["value"][_walk(tree, xv)]
    return raw


def predict(model: Mapping[str, Any], x: Sequence[float], allowed: Iterable[str]) -> tuple[str, float, dict[str, float]]:
    """(best variant among `allowed`, its predicted log gain over BSP, every predicted gain)."""
    allowed = set(allowed) | {BSP}
    if model["kind"] == "gbr":
        known = [v for v in model["variants"] if v in allowed]
        logt = {v: _gbr_log_latency(model, x, v) for v in known}
        gains = {v: logt[BSP] - t for v, t in logt.items()}
    else:
        leaf = _walk(model["tree"], _f32(x))
        gains = {v: g for v, g in (model["leaf_gain"][leaf] or {}).items() if v in allowed}
        gains[BSP] = 0.0
        label = model["classes"][model["tree"]["label"][leaf]]
        if label in allowed:
            return label, gains.get(label, 0.0), gains
    best = max(sorted(gains), key=lambda v: (gains[v], v == BSP))
    return best, gains[best], gains


# ---------------------------------------------------------------------------------------------
# The policy


def _op_or_none(name: str) -> Op | None:
    from autofuse import registry

    try:
        return registry.get(name)
    except Exception:
        return None


def _bsp_config(problem: Problem, op: Op | None) -> Config:
    if op is None or BSP not in op.variants:
        return {}
    return dict(op.variant(BSP).defaults(problem)[0])


def _valid(op: Op | None, problem: Problem, variant: str, config: Config) -> bool:
    return op is None or variant not in op.variants or op.variant(variant).check(problem, config) is None


class Policy:
    """A loaded policy (or the BSP-for-everything fallback): `choose(problem)`.

    Build one with `Policy.load(path)`, `Policy.from_dict(data)` (both check the fingerprint) or
    `Policy.bsp(reason)`; `fit()` returns the data of a new one.
    """

    def __init__(self, data: Mapping[str, Any] | None, source: str = "<memory>", refused: str = ""):
        self.data = dict(data) if data else {}
        self.source = source
        self.refused = refused
        self.ops: dict[str, dict] = dict(self.data.get("ops", {})) if not refused else {}
        self._index: dict[str, dict] = {}

    # construction ----------------------------------------------------------------------------
    @classmethod
    def bsp(cls, reason: str) -> "Policy":
        """The fallback policy: every problem runs BSP, `reason` says why."""
        return cls(None, "<none>", refused=reason)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], fingerprint: Mapping[str, Any] | None = None,
                  source: str = "<memory>") -> "Policy":
        """Check format and fingerprint; a refused policy warns and returns the BSP fallback."""
        problem = _format_problem(data)
        if problem is None:
            fp = fingerprint if fingerprint is not None else environment.fingerprint()
            diff = environment.differences(data["fingerprint"], fp)
            if diff:
                shown = "; ".join(f"{k}: policy {a!r} vs here {b!r}" for k, (a, b) in sorted(diff.items()))
                problem = f"it was fitted on other hardware or versions ({shown})"
        if problem:
            reason = f"policy {source} refused: {problem}; running BSP for every op"
            warnings.warn(reason, PolicyWarning, stacklevel=2)
            return cls.bsp(reason)
        return cls(data, source)

    @classmethod
    def load(cls, path: str | Path, fingerprint: Mapping[str, Any] | None = None) -> "Policy":
        """Read a policy JSON (no code runs); refuse it with a warning unless its fingerprint matches."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            reason = f"policy {path} refused: cannot read it ({type(exc).__name__}: {exc}); running BSP for every op"
            warnings.warn(reason, PolicyWarning, stacklevel=2)
            return cls.bsp(reason)
        return cls.from_dict(data, fingerprint, source=str(path))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=1, sort_keys=True, allow_nan=False) + "\n")
        return path

    @property
    def fingerprint(self) -> dict:
        return dict(self.data.get("fingerprint", {}))

    @property
    def mode(self) -> str:
        return str(self.data.get("mode", ""))

    # decisions -------------------------------------------------------------------------------
    def choose(self, problem: Problem, op: Op | None = None) -> tuple[str, Config, str]:
        """(variant, config, reason) for `problem`."""
        d = self.decide(problem, op)
        return d.variant, d.config, d.reason

    def decide(self, problem: Problem, op: Op | None = None, available: Iterable[str] | None = None) -> Decision:
        """The full decision: variant, config, reason, kind, predicted gain, where the config came from.

        `available` limits the variants (those that can run on the caller's World).
        """
        op = op if op is not None else _op_or_none(problem.op)
        allowed = set(available) if available is not None else (set(op.variants) if op else None)
        if self.refused:
            return self._bsp(problem, op, f"fallback: {self.refused}", "fallback")
        data = self.ops.get(problem.op)
        if data is None:
            return self._bsp(problem, op, f"fallback: policy {self.source} has no model for {problem.op}", "fallback")
        allowed = set(data["variants"]) if allowed is None else allowed & set(data["variants"]) | {BSP}
        tuned = data["problems"].get(problem.key)
        if tuned and BSP in tuned["us"]:
            return self._measured(problem, op, tuned["us"], allowed)
        model = data.get("model")
        if model is None:
            return self._bsp(problem, op, f"unsure: too few tuned {problem.op} problems to fit a model", "unsure")
        x = vector(problem_features(problem, op), data["features"])
        best, gain, _ = predict(model, x, allowed)
        margin = data["margin"] if data.get("margin") is not None else math.inf
        name = model["kind"]
        if best == BSP:
            return self._bsp(problem, op, f"policy ({name}): predicts bsp fastest", "policy", 0.0)
        if gain <= margin:
            err = f"{math.exp(margin):.3f}x" if math.isfinite(margin) else "unknown"
            return self._bsp(problem, op, f"unsure: policy ({name}) predicts {best} {math.exp(gain):.3f}x over bsp, "
                             f"within the model's error {err}: bsp", "unsure", gain)
        config, source = self.config_for(problem, best, op, x)
        if config is None:
            return self._bsp(problem, op, f"fallback: policy ({name}) picked {best} but no tuned config of it "
                             f"accepts {problem.key}", "fallback", gain)
        return Decision(best, config, f"policy ({name}): predicts {best} {math.exp(gain):.3f}x over bsp, above "
                        f"the model's error {math.exp(margin):.3f}x", "policy", gain, source)

    def config_for(self, problem: Problem, variant: str, op: Op | None = None,
                   x: Sequence[float] | None = None) -> tuple[Config | None, str]:
        """The variant's config tuned on the nearest measured problem that it accepts, and its source."""
        op = op if op is not None else _op_or_none(problem.op)
        data = self.ops.get(problem.op)
        if data is not None and not self.refused:
            if x is None:
                x = vector(problem_features(problem, op), data["features"])
            scale = data["scale"]
            ranked = sorted(self._op_index(problem.op).get(variant, []),
                            key=lambda e: (e[0] != problem.key,
                                           sum(((a - b) / s) ** 2 for a, b, s in zip(x, e[1], scale)), e[0]))
            for key, _, config in ranked:
                if _valid(op, problem, variant, config):
                    where = "tuned on this problem" if key == problem.key else f"tuned on nearest problem {key}"
                    return dict(config), where
        if op is not None and variant in op.variants:
            for config in op.variant(variant).defaults(problem):
                if _valid(op, problem, variant, config):
                    return dict(config), "variant default"
        return None, ""

    def _measured(self, problem: Problem, op: Op | None, us: Mapping[str, float], allowed: set[str]) -> Decision:
        ok = {v: t for v, t in us.items() if v in allowed}
        best = min(sorted(ok), key=lambda v: (ok[v], v != BSP))
        gain = math.log(us[BSP] / ok[best])
        if best == BSP:
            return self._bsp(problem, op, "measured: bsp was fastest on this problem when tuned", "measured", 0.0)
        if gain <= math.log1p(MEASURED_MARGIN):
            return self._bsp(problem, op, f"unsure: {best} measured only {math.exp(gain):.3f}x over bsp on this "
                             f"problem (within {MEASURED_MARGIN:.0%} noise): bsp", "unsure", gain)
        config, source = self.config_for(problem, best, op)
        if config is None:
            return self._bsp(problem, op, f"fallback: no config of {best} accepts this problem any more", "fallback", gain)
        return Decision(best, config, f"measured: {best} ran {math.exp(gain):.3f}x faster than bsp on this "
                        "problem when tuned", "measured", gain, source)

    def _bsp(self, problem: Problem, op: Op | None, reason: str, kind: str, gain: float | None = None) -> Decision:
        config, source = (None, "")
        if not self.refused and problem.op in self.ops:
            config, source = self.config_for(problem, BSP, op)
        if config is None:
            config, source = _bsp_config(problem, op), "variant default"
        return Decision(BSP, config, reason, kind, gain, source)

    def _op_index(self, op: str) -> dict[str, list]:
        """Per variant: [(problem key, its features, the config tuned there)], built once."""
        if op not in self._index:
            data = self.ops[op]
            configs: dict[str, list] = {}
            for variant, entries in data["candidates"].items():
                for entry in entries:
                    for key in entry["problems"]:
                        configs.setdefault(variant, []).append((key, data["problems"][key]["x"], entry["config"]))
            self._index[op] = configs
        return self._index[op]


def _format_problem(data: Any) -> str | None:
    """Why `data` is not a policy this version reads, or None."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        return f"not an {FORMAT} file"
    if data.get("format_version") != FORMAT_VERSION:
        return f"format version {data.get('format_version')!r}, this autofuse reads {FORMAT_VERSION}"
    if not isinstance(data.get("fingerprint"), Mapping) or not isinstance(data.get("ops"), Mapping):
        return "it lacks a fingerprint or ops"
    for name, op in data["ops"].items():
        missing = {"features", "variants", "scale", "problems", "candidates", "model", "margin"} - set(op)
        if missing:
            return f"op {name} lacks {sorted(missing)}"
    return None


def file_name(fingerprint: Mapping[str, Any], mode: str) -> str:
    """Conventional file name under models/: '<gpu>-x<count>-<fingerprint id>-<mode>.json'."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(fingerprint.get("gpu_name", "unknown")).lower()).strip("-")
    return f"{gpu}-x{fingerprint.get('gpu_count', 0)}-{fingerprint['id']}-{mode}.json"


# ---------------------------------------------------------------------------------------------
# Fitting


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
    """Group store rows (store.best) by op; drop 'bound*' rows and problems without a BSP row."""
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
        op = ops.get(name) or _op_or_none(name)
        d = OpData(name)
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
                    groups.setdefault(json.dumps(c, sort_keys=True), {"config": c, "problems": []})["problems"].append(key)
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
    return FitResult(data, report, models)
