"""Dispatch policy at run time: load a fitted policy file, validate it, and decide per problem.

The runtime half of the policy (DESIGN.md, Policy and dispatch); fitting lives in
`autofuse.tuning.fit` (scikit-learn), which this module never imports: it reads plain JSON and
walks the exported trees in Python (no numpy, no scikit-learn).

A policy file holds, per op, one of two fitted models:
- `gbr`: a gradient-boosted regressor of log latency from the problem's features plus a one-hot
  of the variant; the predicted gain of variant v over BSP is pred(bsp) - pred(v).
- `tree`: a decision-tree classifier of the fastest variant; each leaf also carries the mean
  measured log gain over BSP of every variant among the training problems that reach it.
Either way a decision has a predicted gain over BSP; where that gain is within the model's measured
error (`margin`) the policy says "unsure" and runs BSP, as PyTorch's AutoHeuristic does. A problem
that was tuned itself uses its measured best (BSP unless the gain beats `MEASURED_MARGIN`). The
config of the chosen variant is the one tuned on the nearest measured problem (standardised feature
distance) that the variant accepts.

Loading runs no code and trusts nothing: `validate` checks the whole structure (every key and type,
feature and child indices in range, trees acyclic with every node reached once and bounded in size
and depth, finite numbers everywhere, positive scales, well-formed leaves) and refuses a file with
one `PolicyWarning` naming it and the first problem found; so does a policy fitted on other
hardware or versions. A refused policy runs BSP for every op.

Its fingerprint is matched layer by layer (`environment.hardware_match`): fitted on this machine,
it is trusted as fitted; on another host of the same hardware kind (GPU model, count and links of
the visible GPUs; or a file that records no machine id), it serves with every decision confirmed
on first use, and `match` / the decision's reason say so; other hardware refuses it.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import warnings
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from autofuse.measure import environment
from autofuse.core.features import problem_features, vector
from autofuse.core.op import Config, Op, Problem
from autofuse.dispatch.choice import NO_PARAMETERS, Choice
from autofuse.dispatch.state import user_stacklevel

FORMAT = "autofuse-policy"
FORMAT_VERSION = 1
BSP = "bsp"
MEASURED_MARGIN = 0.02  # a tuned problem leaves BSP only for a measured gain above 2% (timing noise)
NEAR_CLOSE = 0.05  # variants within this of the nearest tuned problem's fastest: its timing could not tell them apart
# Bounds of what a policy file may hold (far above what `autofuse fit` writes: depth 6, 200 trees of depth 3;
# the shipped policies are about 1 MiB). Every rank of a job parses the file, so its size bounds each one's memory.
MAX_FILE_BYTES = 16 << 20
MAX_TREE_NODES = 1 << 16
MAX_TREE_DEPTH = 64
MAX_TREES = 10_000


class PolicyWarning(UserWarning):
    """A policy was refused (other hardware or versions, unreadable): BSP runs instead."""


# ---------------------------------------------------------------------------------------------
# Walking exported trees (plain Python, what a loaded policy runs)


def _f32(x: Sequence[float]) -> list[float]:
    """Features as float32, exactly as scikit-learn's trees compare them against thresholds."""
    return array("f", [float(v) for v in x]).tolist()


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


def _bsp_config(problem: Problem, op: Op) -> Config:
    return dict(op.variant(BSP).defaults(problem)[0]) if BSP in op.variants else {}


def _valid(op: Op, problem: Problem, variant: str, config: Config) -> bool:
    return variant not in op.variants or op.variant(variant).check(problem, config) is None


class Policy:
    """A loaded policy (or the BSP-for-everything fallback): `choose(problem)`.

    Build one with `Policy.load(path)`, `Policy.from_dict(data)` (both validate the structure and
    check the fingerprint) or `Policy.bsp(reason)`; `autofuse.tuning.fit.fit()` returns the data
    of a new one. `Policy(data)` trusts `data` (fitted in this process).
    """

    def __init__(self, data: Mapping[str, Any] | None, path: str = "<memory>", refused: str = ""):
        self.data = dict(data) if data else {}
        self.path = path
        self.refused = refused
        self.ops: dict[str, dict] = dict(self.data.get("ops", {})) if not refused else {}
        self.stale_ops: dict[str, str] = {}  # op -> why its entries are only predictions (its code changed)
        self.software: dict[str, tuple] = {}  # software fields that differ from this machine's
        self.match = "machine"  # the fingerprint layer it matched by: 'machine' or 'kind' (other host)
        self._index: dict[str, dict] = {}
        self._features: dict[str, list[float]] = {}  # problem key -> feature vector

    # construction ----------------------------------------------------------------------------
    @classmethod
    def bsp(cls, reason: str) -> "Policy":
        """The fallback policy: every problem runs BSP, `reason` says why."""
        return cls(None, "<none>", refused=reason)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], fingerprint: Mapping[str, Any] | None = None,
                  path: str = "<memory>") -> "Policy":
        """Validate the whole structure, then the fingerprint layer by layer (environment.py):
        other hardware refuses the policy (one warning naming `path`, then BSP for every op); another
        host of the same hardware kind (`match` 'kind') is accepted, every decision confirmed on first
        use; other software is accepted with one warning and `software` set, so dispatch confirms
        every decision on first use; an op whose code changed since the fit keeps its entries as
        predictions only (`stale_ops`): dispatch confirms each of its decisions on first use, or runs
        BSP where confirmation is off."""
        problem = validate(data)
        fp: Mapping[str, Any] = {}
        if problem is None:
            fp = fingerprint if fingerprint is not None else environment.fingerprint()
            diff = environment.differences(data["fingerprint"], fp, "hardware")
            if diff:
                shown = "; ".join(f"{k}: policy {a!r} vs here {b!r}" for k, (a, b) in sorted(diff.items()))
                problem = f"it was fitted on other hardware ({shown})"
        if problem:
            reason = f"policy {path} refused: {problem}; every op runs bsp unless forced (AUTOFUSE_VARIANT, variant=)"
            warnings.warn(reason, PolicyWarning, stacklevel=user_stacklevel())
            return cls.bsp(reason)
        policy = cls(data, path)
        policy.match = environment.hardware_match(data["fingerprint"], fp) or "machine"
        ops_here, ops_then = dict(fp.get("ops") or {}), dict(data["fingerprint"].get("ops") or {})
        for name in list(policy.ops):
            if ops_then.get(name) != ops_here.get(name):
                policy.stale_ops[name] = (f"{name}'s code changed since policy {path} was fitted "
                                          f"(digest {ops_then.get(name)} there, {ops_here.get(name)} here)")
        policy.software = environment.differences(data["fingerprint"], fp, "software")
        if policy.software:
            shown = "; ".join(f"{k} {a} there, {b} here" for k, (a, b) in sorted(policy.software.items()))
            warnings.warn(f"policy {path} was fitted with other software ({shown}): it is used, and every "
                          "decision is confirmed by measuring on first use", PolicyWarning, stacklevel=user_stacklevel())
        return policy

    @classmethod
    def load(cls, path: str | Path, fingerprint: Mapping[str, Any] | None = None) -> "Policy":
        """Read a policy JSON (no code runs); refuse it with one warning unless it is well-formed
        throughout and its fingerprint matches this machine."""
        path = Path(path)
        data, why = read_file(path)
        if why:
            reason = f"policy {path} refused: {why}; every op runs bsp unless forced (AUTOFUSE_VARIANT, variant=)"
            warnings.warn(reason, PolicyWarning, stacklevel=user_stacklevel())
            return cls.bsp(reason)
        return cls.from_dict(data, fingerprint, path=str(path))

    def to_json(self) -> str:
        """The policy file's text (plain JSON: NaN or infinity would raise; ValueError if it is larger
        than MAX_FILE_BYTES, which `read_file` would refuse)."""
        text = json.dumps(self.data, indent=1, sort_keys=True, allow_nan=False) + "\n"
        if len(text.encode("utf-8")) > MAX_FILE_BYTES:
            raise ValueError(f"the policy would be {len(text) >> 20} MiB, larger than the {MAX_FILE_BYTES >> 20} MiB "
                             "dispatch reads: fit fewer problems or ops (--op) per policy")
        return text

    def save(self, path: str | Path) -> Path:
        """Write the policy file (replacing `path`; the CLI's `fit` refuses that without --force)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @property
    def fingerprint(self) -> dict:
        return dict(self.data.get("fingerprint", {}))

    @property
    def mode(self) -> str:
        return str(self.data.get("mode", ""))

    # decisions -------------------------------------------------------------------------------
    @property
    def other_host(self) -> bool:
        """Whether the policy was fitted on another host of this hardware kind (or records no machine id)."""
        return self.match == "kind"

    def match_text(self) -> str:
        """The fingerprint layer the policy matched by, for `explain`, e.g. 'hardware kind (other host)'."""
        return environment.MATCHES.get(self.match, self.match)

    def needs_confirmation(self, problem: Problem, decision: Choice) -> bool:
        """Whether `decision` rests on a prediction that dispatch must confirm by measuring on first
        use: a model's pick or an unsure call, a measurement taken with other software or on another
        host, or any entry of an op whose code changed since the fit (stale)."""
        return (decision.basis in ("policy", "unsure") or problem.op in self.stale_ops
                or (decision.basis == "measured" and (bool(self.software) or self.other_host)))

    def decide(self, problem: Problem, op: Op, available: Iterable[str] | None = None) -> Choice:
        """The full decision: variant, config, reason, basis, predicted gain, where the config came from.

        `available` limits the variants (those that can run on the caller's World). For a stale op
        the reason starts with 'stale:' (the entries are predictions until confirmed); for a policy
        fitted on another host it then names that layer ('policy matched by hardware kind (other
        host): confirmed on first use').
        """
        d = self._decide(problem, op, available)
        if self.other_host and d.basis != "fallback":
            d.reason = f"policy matched by {self.match_text()}: confirmed on first use; {d.reason}"
        stale = self.stale_ops.get(problem.op)
        if stale and d.basis != "fallback":
            d.reason = f"stale: {stale}, so this is confirmed on first use; {d.reason}"
        return d

    def _decide(self, problem: Problem, op: Op, available: Iterable[str] | None) -> Choice:
        allowed = set(available) if available is not None else set(op.variants)
        if self.refused:
            return self._bsp(problem, op, f"fallback: {self.refused}", "fallback")
        data = self.ops.get(problem.op)
        if data is None:
            why = self.stale_ops.get(problem.op) or f"policy {self.path} has no model for {problem.op}"
            return self._bsp(problem, op, f"fallback: {why}", "fallback")
        allowed = set(data["variants"]) if allowed is None else allowed & set(data["variants"]) | {BSP}
        # Each variant's config, found once; one that no config accepts (torch's all-reduce on float16, say)
        # is no candidate: the next best runnable one is, rather than BSP by default.
        configs = {v: c for v in allowed - {BSP} if (c := self.config_for(problem, v, op))[0] is not None}
        allowed = set(configs) | {BSP}
        tuned = data["problems"].get(problem.key)
        if tuned and BSP in tuned["us"]:
            return self._measured(problem, op, tuned["us"], configs)
        model = data.get("model")
        if model is None:
            return self._bsp(problem, op, f"unsure: too few tuned {problem.op} problems to fit a model", "unsure")
        x = self.features(problem, op)
        best, gain, _ = predict(model, x, allowed)
        margin = data["margin"] if data.get("margin") is not None else math.inf
        name = model["kind"]
        if best == BSP:
            return self._bsp(problem, op, f"policy ({name}): predicts bsp fastest", "policy", 0.0)
        if gain <= margin:
            err = f"{math.exp(margin):.3f}x" if math.isfinite(margin) else "unknown"
            return self._bsp(problem, op, f"unsure: policy ({name}) predicts {best} {math.exp(gain):.3f}x over bsp, "
                             f"within the model's error {err}: bsp", "unsure", gain)
        config, source = configs[best]
        return self._choice(problem, best, config, f"policy ({name}): predicts {best} {math.exp(gain):.3f}x over bsp, above "
                        f"the model's error {math.exp(margin):.3f}x", "policy", gain, source)

    def config_for(self, problem: Problem, variant: str, op: Op) -> tuple[Config | None, str]:
        """The variant's config tuned on the nearest measured problem that it accepts, and its source."""
        return next(self._configs(problem, variant, op), (None, ""))

    def _configs(self, problem: Problem, variant: str, op: Op) -> Iterator[tuple[Config, str]]:
        """(config, where it comes from) of `variant` that accept `problem`: tuned ones, nearest tuned
        problem first (standardised feature distance), then the variant's defaults."""
        data = self.ops.get(problem.op)
        if data is not None and not self.refused:
            x = self.features(problem, op)
            scale = data["scale"]
            ranked = sorted(self._op_index(problem.op).get(variant, []),
                            key=lambda e: (e[0] != problem.key,
                                           sum(((a - b) / s) ** 2 for a, b, s in zip(x, e[1], scale)), e[0]))
            for key, _, config in ranked:
                if _valid(op, problem, variant, config):
                    yield dict(config), (NO_PARAMETERS if not config else "tuned on this problem"
                                         if key == problem.key else f"tuned on nearest problem {key}")
        if variant in op.variants:
            for config in op.variant(variant).defaults(problem):
                if _valid(op, problem, variant, config):
                    yield dict(config), NO_PARAMETERS if not config else "variant default"

    def candidates(self, problem: Problem, op: Op, available: Iterable[str] | None = None,
                   k: int = 3) -> list[tuple[str, Config]]:
        """The k most promising (variant, config) pairs other than bsp, best first: variants ranked by
        their measured time where this problem was tuned, else by the model's predicted gain over bsp;
        each variant at its nearest tuned config, then further configs of the best variants while
        fewer than k. What dispatch measures when it confirms a decision on first use."""
        data = self.ops.get(problem.op)
        if self.refused or data is None or k < 1:
            return []
        allowed = set(data["variants"]) if available is None else set(available) & set(data["variants"])
        allowed.discard(BSP)
        x = self.features(problem, op)
        tuned = data["problems"].get(problem.key)
        if tuned:
            ranked = sorted((v for v in tuned["us"] if v in allowed), key=lambda v: tuned["us"][v])
        elif data.get("model") is not None:
            _, _, gains = predict(data["model"], x, allowed)
            ranked = sorted((v for v in gains if v in allowed), key=lambda v: (-gains[v], v))
        else:
            ranked = sorted(allowed)
        per_variant = {v: self.configs_for(problem, v, op, k) for v in ranked}
        out: list[tuple[str, Config]] = []
        for depth in range(k):
            for v in ranked:
                if len(out) < k and depth < len(per_variant[v]):
                    out.append((v, per_variant[v][depth]))
        return out

    def confirmation_candidates(self, problem: Problem, op: Op, available: Iterable[str] | None = None,
                                k: int = 3) -> tuple[list[tuple[str, Config]], int]:
        """(what a confirmation on first use measures besides bsp, how many of them it times): the k most
        promising candidates (`candidates`; twice as many listed, the later ones standing in for those
        that cannot run); then, where the model ranks them lower, the variants that won the nearest tuned
        problem or ran within 5% of its winner (`nearest_winners`: the strongest evidence beside the model's
        interpolation; on 2x H200 the model left heap_mm_overlap, within 3% of the winner on the nearest
        tuned k-form ag_gemm problems, out of a held-out k-form problem's top 3 in two rounds, and the
        pick was 1.13x slower than it); and every `peer`
        variant (torch's own ops: what users run instead) that can run here and is not among those,
        timed as well (k + their number). A confirmed pick is then never slower than the alternative or
        the neighbour's winners by more than the timing's noise."""
        cands = self.candidates(problem, op, available, 2 * k)
        if not cands:
            return cands, k
        allowed = None if available is None else set(available)
        first = {v for v, _ in cands[:k]}
        extra: list[tuple[str, Config]] = []
        for near in self.nearest_winners(problem, op, available):
            if near not in first:
                extra += [(near, c) for c in self.configs_for(problem, near, op, 1)]
        peers = [v for v, var in op.variants.items()
                 if var.family == "peer" and (allowed is None or v in allowed)]
        taken = first | {v for v, _ in extra}
        alts = [c for c in (self.candidates(problem, op, peers, len(peers)) if peers else []) if c[0] not in taken]
        extra += alts
        if not extra:
            return cands, k
        added = {v for v, _ in extra}
        return cands[:k] + extra + [c for c in cands[k:] if c[0] not in added], k + len(extra)

    def nearest_winners(self, problem: Problem, op: Op, available: Iterable[str] | None = None,
                        close: float = NEAR_CLOSE) -> list[str]:
        """The variants other than bsp (among `available`, and the op's fitted ones) that ran within `close`
        (relative) of the fastest on the tuned problem nearest to `problem` (standardised feature distance,
        as `config_for` ranks configs) and beat bsp there, fastest first: what that problem's timing could
        not tell apart. Empty where bsp won there or nothing is tuned."""
        data = self.ops.get(problem.op)
        if self.refused or data is None or not data["problems"]:
            return []
        allowed = set(data["variants"]) if available is None else set(available) & set(data["variants"])
        x, scale = self.features(problem, op), data["scale"]
        _, entry = min(data["problems"].items(),
                       key=lambda kv: (sum(((a - b) / s) ** 2 for a, b, s in zip(x, kv[1]["x"], scale)), kv[0]))
        us = {v: t for v, t in entry["us"].items() if v in allowed or v == BSP}
        if not us:
            return []
        best = min(us.values())
        bsp = us.get(BSP, math.inf)
        return [v for v in sorted(us, key=lambda v: (us[v], v)) if v != BSP and us[v] <= best * (1 + close) and us[v] < bsp]

    def configs_for(self, problem: Problem, variant: str, op: Op, n: int = 1) -> list[Config]:
        """Up to `n` distinct configs of `variant` that accept `problem`, in `config_for`'s order."""
        unique: list[Config] = []
        for config, _ in self._configs(problem, variant, op):
            if config not in unique:
                unique.append(config)
                if len(unique) == n:
                    break
        return unique

    def _measured(self, problem: Problem, op: Op, us: Mapping[str, float],
                  configs: Mapping[str, tuple[Config, str]]) -> Choice:
        """The fastest of the tuned variants that can run (`configs`: each one's config and its source) or BSP."""
        ok = {v: t for v, t in us.items() if v in configs or v == BSP}
        best = min(sorted(ok), key=lambda v: (ok[v], v != BSP))
        gain = math.log(us[BSP] / ok[best])
        if best == BSP:
            return self._bsp(problem, op, "measured: bsp was fastest on this problem when tuned", "measured", 0.0)
        if gain <= math.log1p(MEASURED_MARGIN):
            return self._bsp(problem, op, f"unsure: {best} measured only {math.exp(gain):.3f}x over bsp on this "
                             f"problem (within {MEASURED_MARGIN:.0%} noise): bsp", "unsure", gain)
        config, source = configs[best]
        return self._choice(problem, best, config, f"measured: {best} ran {math.exp(gain):.3f}x faster than bsp on this "
                        "problem when tuned", "measured", gain, source)

    def _bsp(self, problem: Problem, op: Op, reason: str, basis: str, gain: float | None = None) -> Choice:
        config, source = (None, "")
        if not self.refused and problem.op in self.ops:
            config, source = self.config_for(problem, BSP, op)
        if config is None:
            config = _bsp_config(problem, op)
            source = NO_PARAMETERS if not config else "variant default"
        return self._choice(problem, BSP, config, reason, basis, gain, source)

    def _choice(self, problem: Problem, variant: str, config: Config, reason: str, basis: str,
                gain: float | None = None, source: str = "") -> Choice:
        return Choice(problem.op, problem, variant, config, reason, basis, self.path, source, gain=gain)

    def features(self, problem: Problem, op: Op) -> list[float]:
        """The problem's feature vector in the op's fitted order, computed once per problem."""
        x = self._features.get(problem.key)
        if x is None:
            x = self._features[problem.key] = vector(problem_features(problem, op), self.ops[problem.op]["features"])
        return x

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


# ---------------------------------------------------------------------------------------------
# Validation: a policy file is data from disk, checked through before any of it is used


class _Bad(Exception):
    """The first problem found in a policy's structure: where, then what."""


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise _Bad(f"{where}: {what}")


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _finite(x: Any, where: str, positive: bool = False) -> None:
    _need(_is_finite(x), where, f"{_show(x)} is not a finite number")
    if positive:
        _need(x > 0, where, f"{_show(x)} must be positive")


def _obj(x: Any, where: str, keys: Sequence[str] = ()) -> Mapping[str, Any]:
    _need(isinstance(x, Mapping), where, f"must be an object, not {type(x).__name__}")
    missing = [k for k in keys if k not in x]
    _need(not missing, where, "lacks " + ", ".join(repr(k) for k in missing))
    return x


def _list(x: Any, where: str, n: int | None = None) -> list:
    _need(isinstance(x, list), where, f"must be a list, not {type(x).__name__}")
    if n is not None:
        _need(len(x) == n, where, f"has {len(x)} entries, expected {n}")
    return x


def _names(x: Any, where: str, unique: bool = True) -> list[str]:
    _list(x, where)
    for i, v in enumerate(x):
        _need(isinstance(v, str), f"{where}[{i}]", f"{_show(v)} is not a string")
    if unique:
        _need(len(set(x)) == len(x), where, "has duplicate entries")
    return x


def _check_tree(tree: Any, where: str, n_features: int, per_node: Sequence[str]) -> list[int]:
    """Check one exported tree; returns its leaves. Every internal node has two children in range and
    a feature index in range; every node is reached exactly once from the root (no cycle, no shared
    node, nothing unreachable); size and depth are bounded; thresholds are finite."""
    t = _obj(tree, where, ("left", "right", "feature", "threshold", *per_node))
    left = _list(t["left"], f"{where}.left")
    n = len(left)
    _need(1 <= n <= MAX_TREE_NODES, f"{where}.left", f"{n} nodes (1 to {MAX_TREE_NODES} allowed)")
    right = _list(t["right"], f"{where}.right", n)
    feature = _list(t["feature"], f"{where}.feature", n)
    threshold = _list(t["threshold"], f"{where}.threshold", n)
    for key in per_node:
        _list(t[key], f"{where}.{key}", n)
    leaves = []
    for i in range(n):
        a, b, f = left[i], right[i], feature[i]
        _need(_is_int(a) and _is_int(b), f"{where} node {i}", f"child indices {_show(a)}, {_show(b)} are not integers")
        _need(_is_int(f), f"{where} node {i}", f"feature index {_show(f)} is not an integer")
        _finite(threshold[i], f"{where}.threshold[{i}]")
        if a == -1 or b == -1:
            _need(a == b == -1, f"{where} node {i}", f"has one child ({a}, {b}); a leaf has left = right = -1")
            leaves.append(i)
            continue
        _need(0 < a < n and 0 < b < n, f"{where} node {i}", f"child index out of range 1..{n - 1}: left {a}, right {b}")
        _need(0 <= f < n_features, f"{where} node {i}", f"feature index {f} out of range 0..{n_features - 1}")
    seen, depth, stack = [False] * n, [0] * n, [0]
    seen[0] = True
    while stack:
        i = stack.pop()
        if left[i] == -1:
            continue
        for c in (left[i], right[i]):
            _need(not seen[c], f"{where} node {c}", "reached twice from the root (a cycle or a shared node)")
            seen[c], depth[c] = True, depth[i] + 1
            _need(depth[c] <= MAX_TREE_DEPTH, where, f"deeper than {MAX_TREE_DEPTH} levels")
            stack.append(c)
    unreached = [i for i in range(n) if not seen[i]]
    _need(not unreached, f"{where} node {unreached[0] if unreached else 0}", "is never reached from the root")
    return leaves


def _check_model(model: Any, where: str, n_features: int, variants: Sequence[str]) -> None:
    m = _obj(model, where, ("kind",))
    if m["kind"] == "gbr":
        _obj(m, where, ("variants", "init", "learning_rate", "trees"))
        mv = _names(m["variants"], f"{where}.variants")
        _need(BSP in mv, f"{where}.variants", "lacks bsp")
        _finite(m["init"], f"{where}.init")
        _finite(m["learning_rate"], f"{where}.learning_rate")
        trees = _list(m["trees"], f"{where}.trees")
        _need(len(trees) <= MAX_TREES, f"{where}.trees", f"{len(trees)} trees (at most {MAX_TREES})")
        for j, tree in enumerate(trees):
            w = f"{where}.trees[{j}]"
            _check_tree(tree, w, n_features + len(mv), ("value",))
            for i, v in enumerate(tree["value"]):
                _finite(v, f"{w}.value[{i}]")
    elif m["kind"] == "tree":
        _obj(m, where, ("classes", "tree", "leaf_gain"))
        classes = _names(m["classes"], f"{where}.classes")
        _need(len(classes) > 0, f"{where}.classes", "is empty")
        _check_tree(m["tree"], f"{where}.tree", n_features, ("label",))
        n = len(m["tree"]["left"])
        for i, label in enumerate(m["tree"]["label"]):
            _need(_is_int(label) and 0 <= label < len(classes), f"{where}.tree.label[{i}]",
                  f"{_show(label)} is not a class index 0..{len(classes) - 1}")
        gains = _list(m["leaf_gain"], f"{where}.leaf_gain", n)
        for i, g in enumerate(gains):
            if g is None:
                continue
            _obj(g, f"{where}.leaf_gain[{i}]")
            for v, x in g.items():
                _finite(x, f"{where}.leaf_gain[{i}][{v!r}]")
    else:
        _need(False, f"{where}.kind", f"{_show(m['kind'])} is not a model kind (gbr or tree)")


def _check_op(name: str, op: Any) -> None:
    w = f"ops.{name}"
    _obj(op, w, ("features", "variants", "scale", "problems", "candidates", "model", "margin"))
    features = _names(op["features"], f"{w}.features")
    variants = _names(op["variants"], f"{w}.variants")
    _need(BSP in variants, f"{w}.variants", "lacks bsp")
    for i, x in enumerate(_list(op["scale"], f"{w}.scale", len(features))):
        _finite(x, f"{w}.scale[{i}]", positive=True)
    problems = _obj(op["problems"], f"{w}.problems")
    for key, p in problems.items():
        wp = f"{w}.problems[{key!r}]"
        _obj(p, wp, ("x", "us"))
        for i, x in enumerate(_list(p["x"], f"{wp}.x", len(features))):
            _finite(x, f"{wp}.x[{i}]")
        for v, t in _obj(p["us"], f"{wp}.us").items():
            _need(v in variants, f"{wp}.us", f"variant {v!r} is not among the op's variants")
            _finite(t, f"{wp}.us[{v!r}]", positive=True)
    for v, entries in _obj(op["candidates"], f"{w}.candidates").items():
        wc = f"{w}.candidates[{v!r}]"
        _need(v in variants, wc, f"variant {v!r} is not among the op's variants")
        for j, entry in enumerate(_list(entries, wc)):
            we = f"{wc}[{j}]"
            _obj(entry, we, ("config", "problems"))
            for k, x in _obj(entry["config"], f"{we}.config").items():
                _need(isinstance(x, (str, int, float, bool)) and (not isinstance(x, float) or math.isfinite(x)),
                      f"{we}.config[{k!r}]", f"{_show(x)} is not a finite number, string or boolean")
            for key in _names(entry["problems"], f"{we}.problems", unique=False):
                _need(key in problems, f"{we}.problems", f"names problem {key!r}, which the policy does not hold")
    if op["margin"] is not None:
        _finite(op["margin"], f"{w}.margin")
        _need(op["margin"] >= 0, f"{w}.margin", f"{op['margin']!r} is negative")
    if op["model"] is not None:
        _check_model(op["model"], f"{w}.model", len(features), variants)


def validate(data: Any) -> str | None:
    """The first reason `data` is not a policy this version can use, or None (see the module docstring)."""
    try:
        _need(isinstance(data, Mapping) and data.get("format") == FORMAT, "file", f"not an {FORMAT} file")
        _need(data.get("format_version") == FORMAT_VERSION, "file",
              f"format version {_show(data.get('format_version'))}, this autofuse reads {FORMAT_VERSION}")
        _obj(data, "policy", ("fingerprint", "ops"))
        for k, v in _obj(data["fingerprint"], "fingerprint").items():
            inner = v.items() if isinstance(v, Mapping) else [(None, v)]  # e.g. "ops": {op: code digest}
            for k2, x in inner:
                _need(x is None or isinstance(x, (str, bool)) or _is_finite(x),
                      f"fingerprint[{k!r}]" + (f"[{k2!r}]" if k2 is not None else ""),
                      f"{_show(x)} is not a string or number")
        _need(isinstance(data["fingerprint"].get("id"), str), "fingerprint", "lacks its id")
        _need(isinstance(data.get("mode", ""), str), "mode", "is not a string")
        for name, op in _obj(data["ops"], "ops").items():
            _check_op(name, op)
    except _Bad as exc:
        return str(exc)
    return None


def read_file(path: str | Path) -> tuple[Any, str]:
    """(the parsed JSON of a policy file, "") or (None, why it cannot be read). Never raises and never
    blocks for a bad file: missing, unreadable, not a regular file (a FIFO, a device such as /dev/zero,
    a folder: refused before reading, without waiting for a writer), larger than MAX_FILE_BYTES (at
    most that many bytes are read, whatever the file claims), not UTF-8, not JSON, nested too deeply."""
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None, "it is not a regular file (a folder, FIFO, socket or device)"
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in opens without a writer
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None, "it is not a regular file (a folder, FIFO, socket or device)"
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            return None, f"it is larger than the {MAX_FILE_BYTES >> 20} MiB a policy may be"
        return json.loads(data.decode("utf-8")), ""
    except RecursionError:
        return None, "cannot read it: JSON nested too deeply"
    except (OSError, ValueError, MemoryError) as exc:
        return None, f"cannot read it ({type(exc).__name__}: {str(exc)[:200]})"


def file_name(fingerprint: Mapping[str, Any], mode: str) -> str:
    """Conventional policy file name: '<gpu>-x<count>-<fingerprint id>-<mode>.json' on GPUs,
    'cpu-emulation-<machine>-<fingerprint id>-<mode>.json' for the CPU emulation (no GPU count)."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(fingerprint.get("gpu_name", "unknown")).lower()).strip("-") or "unknown"
    count = fingerprint.get("gpu_count") or 0
    if fingerprint.get("device_kind") == "cpu" or not count:
        return f"{gpu}-{fingerprint['id']}-{mode}.json"
    return f"{gpu}-x{count}-{fingerprint['id']}-{mode}.json"
