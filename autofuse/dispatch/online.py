"""This machine's online store: decisions confirmed by measuring on first use, kept across processes.

A confirmation's measurements are appended (source `online`) to AUTOFUSE_ONLINE_DB, default
<user cache>/autofuse/online-<hardware id>.db; later processes read it before asking the policy
(basis `confirmed`), and `autofuse fit` reads it too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from autofuse.core import settings
from autofuse.core.op import Op, Problem
from autofuse.comm.world import World
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.confirm import pick
from autofuse.dispatch.state import STATE, warn_once


def online_db(fingerprint: dict) -> Path:
    """This machine's online store: AUTOFUSE_ONLINE_DB, else <user cache>/autofuse/online-<hardware id>.db."""
    return settings.online_db(fingerprint["hardware_id"])


def confirmed_choice(op: Op, world: World, problem: Problem, available: list[str], policy: Any,
                     mode: str) -> Choice | None:
    """The decision an earlier confirmation on this machine measured for `problem` in timing `mode`, if any."""
    kind = world.device.type
    if (kind, mode) not in STATE.confirmed:
        STATE.confirmed[kind, mode] = _load(world, mode)
    measured = STATE.confirmed[kind, mode].get(problem.key)
    if not measured:
        return None
    ok = {v: m for v, m in measured.items() if v in available and op.variant(v).check(problem, m[1]) is None}
    if "bsp" not in ok:
        return None
    best, _ = pick([(v, c, us) for v, (us, c) in sorted(ok.items())])  # the confirming process's rule
    timed = ", ".join(f"{v} {t:.1f} us" for v, (t, _) in sorted(ok.items(), key=lambda x: x[1][0]))
    return Choice(op.name, problem, best, dict(ok[best][1]), f"confirmed: measured on this machine earlier ({timed})",
                  "confirmed", policy.path, "measured on first use")


def _load(world: World, mode: str) -> dict[str, dict]:
    """{problem key: {variant: (us, config)}} of this machine's online store in `mode` (none if absent)."""
    from autofuse.measure import environment
    from autofuse.measure.store import Store, StoreError

    fp = environment.fingerprint(world.device.type)
    path = online_db(fp)
    if not path.is_file():
        return {}
    try:
        # rows of this device kind's environment, as `record` writes them; and the fingerprint the
        # process already has (the store's own default would compute it again: seconds of a first call)
        store = Store.open(path, readonly=True, fingerprint=fp)
        try:
            rows = store.best(None, mode)
        finally:
            store.close()
    except StoreError as exc:
        warn_once(f"autofuse: online store unusable, ignored: {exc}")
        return {}
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["problem"], {})[r["variant"]] = (r["median_us"], r["config"])
    return out


def remember(world: World, problem: Problem, timed: list, mode: str) -> None:
    """Keep this process's view of the store in `mode` up to date with a confirmation's (variant, config, us)."""
    entry = STATE.confirmed.setdefault((world.device.type, mode), {}).setdefault(problem.key, {})
    for variant, config, us in timed:
        if us < entry.get(variant, (float("inf"),))[0]:
            entry[variant] = (us, config)


def record(world: World, problem: Problem, result: Any) -> None:
    """Append a confirmation's measurements (source 'online') to this machine's online store."""
    from autofuse.measure import environment
    from autofuse.measure.store import Store, StoreError
    from autofuse.measure.timing import Measurement

    fp = environment.fingerprint(world.device.type)
    rows = [Measurement(problem, v, dict(c), result.mode, True, median_us=t.median_us, p10_us=t.p10_us,
                        p90_us=t.p90_us, min_us=t.min_us, reps=t.reps,
                        extra={"inner": t.inner, "sets": result.sets, "rounds": result.rounds})
            for (v, c, _), t in zip(result.timed, result.timings)]
    rows += [Measurement(problem, v, dict(c), result.mode, False, error=why) for v, c, why in result.dropped]
    try:
        path = online_db(fp)
        path.parent.mkdir(parents=True, exist_ok=True)
        with Store.open(path) as store:
            store.add(rows, fp, source="online")
    except (StoreError, OSError) as exc:
        warn_once(f"autofuse: could not record confirmed measurements ({exc}); decisions still hold in this process")
