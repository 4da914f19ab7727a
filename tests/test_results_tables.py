"""scripts/results_tables.py renders a committed bench JSON and the committed tuning database (both modes)."""
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUND1 = ROOT / "docs" / "results" / "2026-11-22-round1"
ROUND2 = ROOT / "docs" / "results" / "2026-11-22-round2"
SOURCE = ROUND1 / "bench-gemm_ar-gpu-h200x2-2026-11-22.json"  # round 1's bench JSON format


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
    """Round 2's database (shipped then, kept with its results), read-only, against that round's gemm_ar
    bench JSON: every tuned gemm_ar problem appears once per mode with its bsp latency; the bench's
    problems get a bench column."""
    db = ROUND2 / "h200x2-round2.db"
    bench = ROUND2 / "bench-gemm_ar-gpu.json"
    beside = sorted(db.parent.iterdir())
    cmd = [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--db", str(db), "--op", "gemm_ar",
           "--against", f"bench={bench}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    assert sorted(db.parent.iterdir()) == beside  # read-only: no -wal / -shm left beside the database
    assert out.startswith("### gemm_ar, tuned (`autofuse tune`)")
    header = ("| K | M | trials | bsp us | best fused | fused us | x BSP | fused config | fastest | bench fused us "
              "| bench / tuned |")
    assert out.count(header) == 2
    assert out.index("#### graph mode") < out.index("#### eager mode")
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    bsp = con.execute("SELECT problem, mode, MIN(median_us) FROM measurements "
                      "WHERE op = 'gemm_ar' AND variant = 'bsp' AND ok = 1 GROUP BY problem, mode").fetchall()
    con.close()
    sections = {"graph": out[out.index("#### graph mode"):out.index("#### eager mode")].splitlines(),
                "eager": out[out.index("#### eager mode"):].splitlines()}
    for problem, mode, us in bsp:
        dims = dict(item.split("=") for item in problem.split("|")[1].split(","))
        head, tail = f"| {dims['K']} | {dims['M']} | ", f" | {us:.1f} | "
        rows = [line for line in sections[mode] if line.startswith(head) and tail in line]
        assert len(rows) == 1, f"missing {problem} {mode}"
        assert int(rows[0][len(head):].split(" | ")[0]) >= 1  # the trials column
    benched = {r["problem"] for r in json.loads(bench.read_text())["rows"]}
    assert out.count("Geomean over 10 problems") == 2 and len(benched) == 3
    assert "Geomean bench best fused / tuned" in out


def test_fit_and_eval_tables_from_committed_reports():
    script, results = str(ROOT / "scripts" / "results_tables.py"), ROUND1
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


def _scaling_db(path: Path) -> Path:
    """A tune database (the tables results_tables reads) with gemm_ar at M=64 and 1024 on world 1, 2, 4."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE problems (key TEXT PRIMARY KEY, op TEXT, dtype TEXT, world INTEGER, dims TEXT)")
    con.execute("CREATE TABLE environments (id TEXT PRIMARY KEY, gpu_name TEXT)")
    con.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, problem TEXT, op TEXT, variant TEXT, config TEXT, "
                "mode TEXT, ok INTEGER, median_us REAL, source TEXT, created_at TEXT)")
    con.execute("INSERT INTO environments VALUES ('e1', 'cpu')")
    for world in (1, 2, 4):
        for m in (64, 1024):
            key = f"gemm_ar|K=64,M={m},N=32|float32|w{world}"
            con.execute("INSERT INTO problems VALUES (?, 'gemm_ar', 'float32', ?, ?)",
                        (key, world, json.dumps({"K": 64, "M": m, "N": 32})))
            for variant, us in (("bsp", 100.0 * m / world), ("one_shot", 80.0 * m / world if m > 100 else 1e6)):
                con.execute("INSERT INTO measurements (problem, op, variant, config, mode, ok, median_us, source, "
                            "created_at) VALUES (?, 'gemm_ar', ?, '{}', 'eager', 1, ?, 'tune', '2026-11-22')",
                            (key, variant, us))
    con.execute("INSERT INTO problems VALUES ('gemm_ar|K=64,M=8,N=32|float32|w2', 'gemm_ar', 'float32', 2, "
                "'{\"K\": 64, \"M\": 8, \"N\": 32}')")  # one world size only: not in the scaling table
    con.execute("INSERT INTO measurements (problem, op, variant, config, mode, ok, median_us, source, created_at) "
                "VALUES ('gemm_ar|K=64,M=8,N=32|float32|w2', 'gemm_ar', 'bsp', '{}', 'eager', 1, 5.0, 'tune', 'x')")
    con.commit()
    con.close()
    return path


def test_strong_scaling_tables_from_db(tmp_path):
    db = _scaling_db(tmp_path / "w.db")
    before = db.read_bytes()
    cmd = [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--db", str(db), "--op", "gemm_ar", "--scaling"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("### gemm_ar, strong scaling")
    assert "#### eager mode (K=64, N=32)" in out
    assert ("| M | w1 fastest | w1 us | w2 fastest | w2 us | w2 speedup | w4 fastest | w4 us | w4 speedup |"
            in out)
    assert "| 64 | bsp | 6400.0 | bsp | 3200.0 | 2.00 | bsp | 1600.0 | 4.00 |" in out
    assert "| 1024 | one_shot | 81920.0 | one_shot | 40960.0 | 2.00 | one_shot | 20480.0 | 4.00 |" in out
    assert "| 8 |" not in out
    assert db.read_bytes() == before
    # the tuned table shows the world size as a column when it varies
    out = subprocess.run(cmd[:-1], check=True, capture_output=True, text=True, timeout=60).stdout
    assert "| M | world | trials |" in out


def test_extra_target_bench_json_renders_its_rows(tmp_path):
    doc = {"target": "collectives", "sweep": "cpu", "date": "2026-11-22", "fingerprint": {"gpu_name": "cpu"},
           "rows": [{"collective": "all_reduce", "bytes": 1024, "us": 12.345, "extra": {"x": 1}},
                    {"collective": "all_gather", "bytes": 2048, "us": None}]}
    path = tmp_path / "bench-collectives.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_tables.py"), str(path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("### collectives, sweep `cpu`")
    assert "| collective | bytes | us |" in out
    assert "| all_reduce | 1024 | 12.35 |" in out and "| all_gather | 2048 | - |" in out
