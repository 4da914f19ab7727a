"""The option handling the extra bench targets share (autofuse.bench.target_options: moe, train_layer,
train_model, layer) and spawn's environment helper (autofuse.comm.world.temporary_env); no ranks started."""
from __future__ import annotations

import os

import pytest

from autofuse.bench import target_options
from autofuse.bench.bench import BenchOptions
from autofuse.comm.world import temporary_env
from autofuse.measure.compare import INTERPRETED_NOTE


def test_setting_on_cpu_caps_reps_and_says_so() -> None:
    s = target_options.setting(BenchOptions(target="moe", device_kind="cpu", reps=20), cpu_reps=3)
    assert (s.kind, s.world, s.modes, s.reps, s.interpreted) == ("cpu", 2, ["eager"], 3, True)
    assert s.notes == [INTERPRETED_NOTE, "reps capped at 3 on CPU (asked for 20)"]
    s = target_options.setting(BenchOptions(target="moe", device_kind="cpu", reps=2, world=3, modes=["eager"]), 3)
    assert (s.world, s.reps, s.notes) == (3, 2, [INTERPRETED_NOTE])

    s = target_options.setting(BenchOptions(target="layer", device_kind="cpu", reps=30), 3, "the layer's own note")
    assert s.notes == ["the layer's own note", "reps capped at 3 on CPU (asked for 30)"]


def test_setting_on_gpus_keeps_reps_and_every_mode(monkeypatch) -> None:
    import autofuse.comm.world as world

    monkeypatch.setattr(world, "gpu_count", lambda: 4)
    s = target_options.setting(BenchOptions(target="train_layer", device_kind="cuda", reps=50), cpu_reps=3)
    assert (s.kind, s.world, s.modes, s.reps, s.interpreted, s.notes) == ("cuda", 4, ["eager", "graph"], 50, False, [])


def test_contenders_default_to_every_known_one_and_name_the_unknown() -> None:
    known = ("autofuse", "torch-tp")
    assert target_options.contenders(None, known) == ["autofuse", "torch-tp"]
    assert target_options.contenders(["torch-tp"], known) == ["torch-tp"]
    with pytest.raises(ValueError, match=r"unknown contenders \['nope'\]: choose among autofuse, torch-tp"):
        target_options.contenders(["autofuse", "nope"], known)


def test_optional_contenders_run_only_by_name() -> None:
    known, optional = ("autofuse", "torch-tp"), ("autofuse-compiled-graph",)
    assert target_options.contenders(None, known, optional) == ["autofuse", "torch-tp"]
    assert target_options.contenders(["autofuse-compiled-graph", "torch-tp"], known, optional) == [
        "autofuse-compiled-graph", "torch-tp"]
    with pytest.raises(ValueError, match="choose among autofuse, torch-tp, autofuse-compiled-graph"):
        target_options.contenders(["nope"], known, optional)


def test_token_counts_parse_items_and_check_the_world() -> None:
    assert target_options.token_counts(None, (16, 32)) == [16, 32]
    assert target_options.token_counts(["T=16,32", "64"], (1,), world=2) == [16, 32, 64]
    assert target_options.token_counts(["3"], (1,)) == [3]  # no world: no divisibility asked
    with pytest.raises(ValueError, match=r"token counts \[3, 5\] are not divisible by the world size 2"):
        target_options.token_counts(["3,4,5"], (1,), world=2)


def test_temporary_env_sets_then_restores_or_removes(monkeypatch) -> None:
    monkeypatch.setenv("AUTOFUSE_TEST_KEPT", "before")
    monkeypatch.delenv("AUTOFUSE_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with temporary_env({"AUTOFUSE_TEST_KEPT": "inside", "AUTOFUSE_TEST_NEW": "1"}):
            assert (os.environ["AUTOFUSE_TEST_KEPT"], os.environ["AUTOFUSE_TEST_NEW"]) == ("inside", "1")
            raise RuntimeError("the block failed")
    assert os.environ["AUTOFUSE_TEST_KEPT"] == "before" and "AUTOFUSE_TEST_NEW" not in os.environ


def test_bench_moe_keeps_the_ranks_notes_beside_its_own(monkeypatch) -> None:
    """A contender refused on a problem is a note of the ranks' result; run() adds the setting's notes to
    it instead of replacing it (they were lost)."""
    import autofuse.comm.world as world
    from autofuse.bench import bench_moe

    refused = "hybrid refused on tiny T=4: ValueError: no"
    monkeypatch.setattr(world, "spawn", lambda *a, **k: [{"rows": [], "notes": [refused], "contenders": [],
                                                         "modes": ["eager"], "device": "cpu"}])
    result = bench_moe.run(BenchOptions(target="moe", device_kind="cpu", world=2, reps=5, progress=False))
    assert result["notes"] == [INTERPRETED_NOTE, "reps capped at 3 on CPU (asked for 5)", refused], result["notes"]


def test_each_autofuse_contender_runs_in_its_training_mode() -> None:
    """bench_train_layer.in_mode (both training benches): before each call, autofuse-compiled-graph's training
    calls are set to graph mode, every other autofuse contender's back to AUTOFUSE_TRAIN_MODE's; torch's
    contenders are left as they are."""
    from autofuse.bench.bench_train_layer import in_mode
    from autofuse.dispatch.state import STATE

    seen = []
    try:
        for name in ("autofuse-compiled-graph", "torch-tp", "autofuse-compiled", "autofuse-compiled-graph", "autofuse"):
            in_mode(name, lambda: seen.append(STATE.train_mode))()
    finally:
        STATE.train_mode = None
    assert seen == ["graph", "graph", None, "graph", None]
