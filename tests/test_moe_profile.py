"""scripts/moe_profile_gpu.py's CPU dry run: every pair's block and combine alone are timed and profiled (CPU ops
on 2 interpreter ranks; on GPUs the same script profiles kernels under CUDA-graph replay)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_script_times_and_profiles_every_pair_and_its_combine_alone(tmp_path):
    out = tmp_path / "profile.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "moe_profile_gpu.py"), "--world", "2", "--model", "tiny",
                          "--tokens", "4", "--reps", "1", "--pairs", "fused/hybrid", "--long-batch-us", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["mode"] == "eager" and got["device"] == "cpu"
    assert list(got["steps"]) == ["block fused/hybrid", "combine hybrid after fused"]
    for name, step in got["steps"].items():
        assert step["latency_us"] > 0 and step["latency_long_us"] > 0, name
        assert step["kernels"] and step["busy_us"] > 0, name
    assert "== block fused/hybrid" in res.stdout
