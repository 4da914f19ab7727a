"""The shipped policies (models/) and tuning database (tuning_db/): valid, and stale entries handled.

A policy entry was measured with the code of its op at fit time (autofuse/measure/environment.py:
per-op code digests). A commit that edits an op, its kernels or a module they use makes that op's
shipped entries *stale*. A correctness fix must never wait for a tuning machine, so stale entries
are not dropped: dispatch uses them as predictions and confirms every decision of a stale op on
first use (or runs BSP where confirmation is off). These tests check that rule on the shipped
files and list the stale ops (docs/results/README.md names them) instead of failing on them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofuse.core import registry
from autofuse.core.op import Problem
from autofuse.dispatch.policy import Policy, read_file, validate
from autofuse.measure import environment
from autofuse.measure.store import ALL, Store

ROOT = Path(__file__).resolve().parents[1]
POLICIES = sorted((ROOT / "models").glob("*.json"))


def stale_ops(data: dict) -> list[str]:
    """The ops of a policy's data whose code changed since it was fitted."""
    then, now = data["fingerprint"].get("ops", {}), environment.op_digests()
    return sorted(op for op in data["ops"] if then.get(op) != now.get(op))


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
def test_shipped_policy_is_valid_and_stale_ops_are_confirmed(path, capsys):
    data, why = read_file(path)
    assert data is not None, why
    assert validate(data) is None, validate(data)
    stale = stale_ops(data)
    # Loaded on the machine it was fitted on (its own fingerprint, today's op digests):
    here = dict(data["fingerprint"], ops=environment.op_digests())
    policy = Policy.from_dict(data, here, path=str(path))
    assert sorted(policy.stale_ops) == stale
    assert set(policy.ops) == set(data["ops"]), "stale ops keep their entries (as predictions)"
    for op in data["ops"]:
        key = next(iter(data["ops"][op]["problems"]))  # a tuned problem of the op
        problem = Problem.from_key(key)
        d = policy.decide(problem, registry.get(op))
        assert d.variant in data["ops"][op]["variants"], d
        if op in stale:
            assert d.reason.startswith("stale:") and policy.needs_confirmation(problem, d), (op, d)
        else:
            assert not d.reason.startswith("stale:"), (op, d)
    with capsys.disabled():
        print(f"\n{path.name}: stale ops (confirmed on first use): {', '.join(stale) or 'none'}")


NOT_SHIPPED = {"moe_dispatch", "moe_combine"}  # added after the last GPU round (issue 41): no tuned rows yet
SHIPPED_DBS = sorted((ROOT / "tuning_db").glob("*.db"))


@pytest.mark.parametrize("db", SHIPPED_DBS, ids=[p.stem for p in SHIPPED_DBS])
def test_shipped_database_holds_rows_of_every_op(db):
    """Every shipped database holds rows of every op, its exported tables beside it, and a policy in
    models/ fitted on it for each mode it holds (the same hardware and op digests)."""
    with Store.open(db, readonly=True) as store:
        rows = store.measurements(None, None, hardware_id=ALL, op_digest=ALL)
    assert {r["op"] for r in rows} >= set(environment.op_digests()) - NOT_SHIPPED, f"{db.name}: an op has no rows"
    for mode in {r["mode"] for r in rows}:
        table = json.loads((ROOT / "tuning_db" / f"tuning-{db.stem}-{mode}.json").read_text())
        assert table, f"the exported {mode} tuning table of {db.name} is empty"
        hardware = {r["hardware_id"] for r in rows if r["mode"] == mode}
        fitted = [json.loads(p.read_text()) for p in (ROOT / "models").glob(f"*-{mode}.json")]
        assert any(d["fingerprint"]["hardware_id"] in hardware and d.get("mode") == mode for d in fitted), \
            f"no {mode} policy in models/ fitted on {db.name}"
