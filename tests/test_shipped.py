"""The shipped policies (models/) and tuning database (tuning_db/) still describe today's code.

A policy entry applies only while its op's code digest is unchanged (autofuse/environment.py): a
commit that edits an op, its kernels or a module they use makes the shipped entries of that op
stale, and users would silently get BSP for it. This test names every stale op so that such a
commit fails CI until the op is re-tuned and the policy re-fitted (or the file is removed).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofuse import environment
from autofuse.policy import read_file, validate
from autofuse.store import ALL, Store

ROOT = Path(__file__).resolve().parents[1]
POLICIES = sorted((ROOT / "models").glob("*.json"))


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
def test_shipped_policy_is_valid_and_current(path):
    data, why = read_file(path)
    assert data is not None, why
    assert validate(data) is None, validate(data)
    digests = data["fingerprint"].get("ops", {})
    now = environment.op_digests()
    stale = {op: (digests.get(op), now.get(op)) for op in data["ops"] if digests.get(op) != now.get(op)}
    assert not stale, (f"{path.name}: the code of {sorted(stale)} changed since this policy was fitted "
                       f"(digest then, now: {stale}); re-tune and re-fit on the GPU machine, or remove the file")


def test_shipped_database_holds_rows_of_todays_code():
    db = ROOT / "tuning_db" / "h200x2.db"
    with Store.open(db, readonly=True) as store:
        rows = store.measurements(None, None, hardware_id=ALL, op_digest=ALL)
    now = environment.op_digests()
    current = {r["op"] for r in rows if r["op_digest"] == now.get(r["op"])}
    assert current == set(now), f"{db.name}: no rows of today's code for {sorted(set(now) - current)}"
    graph = json.loads((ROOT / "tuning_db" / "tuning-h200x2-graph.json").read_text())
    assert graph, "the exported tuning table is empty"
