"""`autofuse bench OP --profile` on CPU ranks: every measured variant gets a per-kernel breakdown in the
JSON and a table at 80 columns; kernel names shorten the way GPU traces need."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from autofuse.bench.kernel_profile import _union_us, short_name


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_cpu_op_bench_profile(tmp_path):
    """Two variants (BSP and a fused Triton kernel under the interpreter) on 2 CPU ranks, one problem."""
    env = dict(os.environ, COLUMNS="80")
    cmd = [sys.executable, "-m", "autofuse", "bench", "gemm_ar", "--variants", "bsp,one_shot", "--limit", "1",
           "--reps", "2", "--profile", "--out", "p.json"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["options"]["profile"] is True and len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert sorted(row["profile"]) == sorted(row["us"]) == ["bsp", "one_shot"], row
    for variant, got in row["profile"].items():
        assert "error" not in got, got
        assert got["mode"] == "eager" and got["config"] == row["config"][variant] and got["calls"] >= 20
        assert got["latency_us"] == row["us"][variant]
        for key in ("busy_us", "kernel_us", "window_us", "launches"):
            assert _finite(got[key]), (variant, key, got[key])
        assert got["kernels"], variant
        for k in got["kernels"]:
            assert k["name"] and _finite(k["calls"]) and k["calls"] > 0 and _finite(k["us"]) and _finite(k["share"])
        assert abs(sum(k["share"] for k in got["kernels"]) - 1) < 1e-6
    assert any(k["name"] == "aten::mm" for k in row["profile"]["bsp"]["kernels"])
    assert f"profile of {row['problem']}, eager mode" in res.stdout
    assert "  one_shot: measured" in res.stdout and "profile of one_shot on" in res.stdout
    tables = [line for line in res.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert tables and max(len(line) for line in tables) <= 80


def test_profile_needs_an_op(tmp_path):
    from typer.testing import CliRunner

    from autofuse.cli import app

    res = CliRunner().invoke(app, ["bench", "collectives", "--profile"])
    assert res.exit_code == 1 and "--profile profiles an op's variants" in res.output


def test_short_kernel_names():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                      "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)") \
        == "vectorized_elementwise_kernel[FillFunctor]"
    assert short_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    assert short_name("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert short_name("gemm_ar_kernel") == "gemm_ar_kernel"


def test_busy_time_counts_overlap_once():
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert _union_us([(0, 10), (2, 3)]) == 10
    assert _union_us([]) == 0
