"""scripts/results_tables.py renders a committed bench JSON and the committed tuning database (both modes)."""
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "results" / "bench-gemm_ar-gpu-h200x2-2026-11-22.json"


def test_tables_from_committed_json():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_tables.py"), str(SOURCE)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    doc = json.loads(SOURCE.read_text())
    assert out.startswith("### gemm_ar, sweep `gpu`")
    header = ("| M | bsp us | one_shot us | two_shot us | matmul us | all_reduce us | bound us | best fused | x BSP "
              "| fused / bound | spread % bsp / fused |")
    assert out.count(header) == 2  # graph and eager
    assert out.index("#### graph mode") < out.index("#### eager mode")
    lines = out.splitlines()
    for row in doc["rows"]:
        cells = f"| {row['M']} | {row['best_us']['bsp']:.1f} | "
        assert sum(line.startswith(cells) for line in lines) == 1, f"missing {row['problem']} {row['mode']}"
    assert out.count("Geomean over 8 problems") == 2


def test_tuned_tables_from_committed_db():
    db = ROOT / "tuning_db" / "h200x2.db"
    cmd = [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--db", str(db), "--op", "gemm_ar",
           "--against", f"bench={SOURCE}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("### gemm_ar, tuned (`autofuse tune`)")
    header = ("| M | trials | bsp us | best fused | fused us | x BSP | fused config | fastest | bench fused us "
              "| bench / tuned |")
    assert out.count(header) == 2
    assert out.index("#### graph mode") < out.index("#### eager mode")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    bsp = dict(con.execute("SELECT problem || mode, median_us FROM measurements "
                           "WHERE op = 'gemm_ar' AND variant = 'bsp' AND ok = 1").fetchall())
    con.close()
    lines = out.splitlines()
    for row in json.loads(SOURCE.read_text())["rows"]:
        cells = f"| {row['M']} | 2 | {bsp[row['problem'] + row['mode']]:.1f} | "
        assert sum(line.startswith(cells) for line in lines) == 1, f"missing {row['problem']} {row['mode']}"
    assert out.count("Geomean over 8 problems") == 2 and out.count("Geomean bench best fused / tuned") == 2


def test_fit_and_eval_tables_from_committed_reports():
    script, results = str(ROOT / "scripts" / "results_tables.py"), ROOT / "docs" / "results"
    fit = results / "fit-graph-h200x2-2026-11-22.json"
    out = subprocess.run([sys.executable, script, "--fit", str(fit)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    doc = json.loads(fit.read_text())
    for op, o in doc["ops"].items():
        assert f"| {op} | {o['problems']} | {o['kept']} (kept) |" in out
        assert f"| {op} | {o['problems']} | always bsp |" in out and f"| {op} | {o['problems']} | oracle |" in out
    ev = results / "eval-dispatch-graph-h200x2-2026-11-22.json"
    out = subprocess.run([sys.executable, script, "--eval", str(ev)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    doc = json.loads(ev.read_text())
    assert out.startswith("| op | calls | within 5% |")
    assert f"| all | {len(doc['rows'])} | {100 * doc['summary']['all']['within_5pct']:.0f}% |" in out
    misses = sum(r["pick_us"] > 1.05 * min(list(r["us"].values()) + [r["pick_us"]]) for r in doc["rows"])
    assert out.count("| **no** |") == misses
    for r in doc["rows"]:
        assert f"| {r['op']} | {r['problem'].split('|')[1]} | {r['pick']} | {r['kind']} | {r['pick_us']:.1f} |" in out
