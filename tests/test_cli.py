"""The command line as a new user meets it, on CPU: --version, help texts, the modes a database holds,
tables at 80 columns, strong scaling, read-only databases, outputs that never replace files, foreign
text with rich markup, bench targets and the CPU op benchmark."""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autofuse.measure import environment
from autofuse.cli import app

ROOT = Path(__file__).resolve().parents[1]
FP = environment.fingerprint("cpu")
# Made-up timings are recorded as a GPU's: the CPU emulation's timings are never shown as speedups.
GPU_FP = {k: v for k, v in FP.items() if k not in ("id", "hardware_id", "software_id")}
GPU_FP.update(device_kind="cuda", gpu_name="Test GPU", gpu_count=4, topology="NV4", driver="1", cuda="1", nccl="1")
SIZES = (64, 1024, 16384)
WORLDS = (1, 2, 4)


def _best(m: int, world: int) -> str:
    return "push" if m < 1000 else "pull"


def _latency(variant: str, m: int, world: int) -> float:
    """bsp 10 + m/100/world us; push 10% faster below M=1000, pull 20% faster from there on."""
    bsp = 10.0 + m / 100 / world
    if variant == "bsp":
        return bsp
    fast = variant == _best(m, world)
    return bsp * (0.9 if variant == "push" and fast else 0.8 if fast else 1.15)


def make_db(path: Path, modes: tuple[str, ...] = ("eager",), fp: dict = GPU_FP) -> Path:
    """A tuning database with ag_gemm at M in SIZES on world sizes 1, 2, 4 (written through the store),
    recorded as measured in `fp` (a made-up GPU by default)."""
    from autofuse.core.op import Problem
    from autofuse.measure.store import Store
    from autofuse.measure.timing import Measurement

    ms = []
    for world in WORLDS:
        for m in SIZES:
            p = Problem.make("ag_gemm", "bfloat16", world, M=m, N=14336 // world, K=8192, gather="rows")
            for v in ("bsp", "pull", "push"):
                for mode in modes:
                    t = _latency(v, m, world)
                    ms.append(Measurement(p, v, {} if v == "bsp" else {"BLOCK_M": 64}, mode, True, median_us=t,
                                          p10_us=t * 0.99, p90_us=t * 1.01, min_us=t * 0.98, reps=3))
    store = Store.open(path) if hasattr(Store, "open") else Store(path)
    try:
        store.add(ms, fp, source="tune")
    finally:
        store.close()
    return path


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return make_db(tmp_path_factory.mktemp("cli") / "autofuse.db")


@pytest.fixture
def runner(monkeypatch, tmp_path) -> CliRunner:
    """A CliRunner in an empty current directory, 80 columns, the user data directory under tmp."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    return CliRunner()


def _flat(text: str) -> str:
    """`text` with its line breaks folded: rich wraps a message at 80 columns wherever a long path puts the break."""
    return " ".join(text.split())


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# first run


def test_version(runner):
    from autofuse import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output, res.output


def test_help_keeps_extras_and_names_the_bench_file(runner):
    res = runner.invoke(app, ["show", "--help"])
    assert res.exit_code == 0 and "autofuse[plot]" in res.output, res.output
    res = runner.invoke(app, ["bench", "--help"])
    text = " ".join(res.output.split())
    assert "bench-TARGET-SWEEP-wWORLD-DATE.json" in text.replace("- ", "-") and "autofuse-out" in text, text
    assert "collectives, gemm_core, layer" in text
    res = runner.invoke(app, ["doctor", "--help"])
    assert "--world" in res.output and "--out" in res.output and "--json" in res.output
    assert "--ranks" not in res.output


def test_modes_default_to_what_the_database_holds(runner, db):
    res = runner.invoke(app, ["show", "--db", str(db)])
    assert res.exit_code == 0, res.output
    assert "--mode not given: reading the eager mode" in _flat(res.stderr)
    res = runner.invoke(app, ["show", "--db", str(db), "--mode", "graph"])
    assert res.exit_code == 1 and "no graph-mode measurements" in _flat(res.output) and "--mode eager" in _flat(res.output)
    assert len(res.output.strip().splitlines()) == 1, res.output


def _check_80(text: str) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in text and "..." not in text


def test_tables_are_readable_at_80_columns(runner, db):
    res = runner.invoke(app, ["show", "--db", str(db)])
    assert res.exit_code == 0
    _check_80(res.stdout)
    for m in SIZES:
        assert re.search(rf"│ {m}\s+│", res.stdout), m
    for header in ("bsp", "pull", "push", "best", "x BSP", "M", "world"):
        assert re.search(rf"[┃│] *{re.escape(header)} *[┃│]", res.stdout) or header.split()[0] in res.stdout, header
    res = runner.invoke(app, ["fit", "--db", str(db), "--out", "p.json"])
    assert res.exit_code == 0, res.output
    _check_80(res.stdout)
    assert "within" in res.stdout and "oracle" in res.stdout and "gbr" in res.stdout


# ---------------------------------------------------------------------------------------------
# strong scaling


def test_strong_scaling_table(runner, db):
    res = runner.invoke(app, ["show", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    scaling = json.loads(res.stdout)["eager"]["scaling"]
    assert [s["worlds"] for s in scaling] == [list(WORLDS)] * len(SIZES)
    for s, m in zip(scaling, SIZES):
        assert s["sizes"] == f"ag_gemm|K=8192,M={m},N=14336,gather=rows|bfloat16"  # N: global
        for w in WORLDS:
            pw = s["per_world"][str(w)]
            assert pw["variant"] == _best(m, w) and pw["us"] == pytest.approx(_latency(_best(m, w), m, w))
            assert pw["speedup_vs_smallest"] == pytest.approx(_latency(_best(m, 1), m, 1) / pw["us"])
    res = runner.invoke(app, ["show", "--db", str(db)])
    assert "strong scaling" in _flat(res.stdout)
    assert all(h in res.stdout for h in ("w1", "w2", "w4", "speedup"))


def test_scaling_sizes_are_global():
    from autofuse.commands.results import scaling_sizes

    assert scaling_sizes("ag_gemm|K=8192,M=64,N=1792,gather=rows|bfloat16|w4") == \
        ("ag_gemm|K=8192,M=64,N=7168,gather=rows|bfloat16", 4)
    assert scaling_sizes("flash_decode|B=8,D=128,Hkv=8,Hq=64,S=4096|bfloat16|w2")[0] == \
        "flash_decode|B=8,D=128,Hkv=8,Hq=64,S=8192|bfloat16"
    assert scaling_sizes("gemm_ar|K=28672,M=32,N=8192|bfloat16|w2") == ("gemm_ar|K=28672,M=32,N=8192|bfloat16", 2)
    assert scaling_sizes("not_an_op|X=3|float32|w2") == ("not_an_op|X=3|float32", 2)


def test_scaling_sweeps_hold_one_global_problem_set_at_every_world_size():
    from autofuse.core import registry
    from autofuse.commands.results import scaling_sizes

    for name in registry.names():
        sets = [[scaling_sizes(p.key)[0] for p in registry.get(name).sweep("scaling", w)] for w in (1, 2, 4, 8)]
        assert sets[0] and all(s == sets[0] for s in sets), name


def test_export_writes_tables_and_strong_scaling(runner, db, tmp_path):
    res = runner.invoke(app, ["export", "--db", str(db), "--format", "json"])
    assert res.exit_code == 0, res.output
    table = json.loads((tmp_path / "autofuse-out" / "tuning-eager.json").read_text())
    assert len(table) == len(SIZES) * len(WORLDS)
    scaling = json.loads((tmp_path / "autofuse-out" / "scaling-eager.json").read_text())
    assert len(scaling) == len(SIZES) * len(WORLDS)
    row = next(r for r in scaling if r["M"] == 16384 and r["world"] == 4)
    assert row["variant"] == "pull" and row["smallest_world"] == 1
    assert row["speedup_vs_smallest_world"] == pytest.approx(_latency("pull", 16384, 1) / _latency("pull", 16384, 4))
    res = runner.invoke(app, ["export", "--db", str(db), "--out", "t.csv"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t-scaling.csv").read_text().splitlines()[0].startswith("op,sizes,dtype")


def test_plot_draws_strong_scaling(runner, db, tmp_path):
    pytest.importorskip("matplotlib")
    res = runner.invoke(app, ["show", "--db", str(db), "--plot", "p.png"])
    assert res.exit_code == 0 and (tmp_path / "p.png").stat().st_size > 0, res.output
    res = runner.invoke(app, ["show", "--db", str(db), "--plot", "p.png"])
    assert res.exit_code == 1 and "exists" in res.output


def _drawn_axes(monkeypatch) -> list:
    """The axes of every figure `show --plot` saves (matplotlib's Figure.savefig, recorded)."""
    from matplotlib.figure import Figure

    axes, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (axes.extend(fig.axes), save(fig, *a, **k))[1])
    return axes


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_plot_leaves_no_panel_blank(runner, tmp_path, monkeypatch, kind):
    """Every panel of `show --plot` is drawn and holds data: on CPU (interpreter timings, no speedups) a
    series' latencies and a strong scaling's take the row's whole width, no empty speedup panel beside."""
    pytest.importorskip("matplotlib")
    db = make_db(tmp_path / f"{kind}.db", fp=FP if kind == "cpu" else GPU_FP)
    axes = _drawn_axes(monkeypatch)
    res = runner.invoke(app, ["show", "--db", str(db), "--plot", "p.png"])
    assert res.exit_code == 0 and axes, res.output
    for ax in axes:
        data = [line for line in ax.get_lines() if line.get_label() not in ("ideal", "bound")
                and any(math.isfinite(y) for y in line.get_ydata())]
        assert ax.axison and data, (kind, ax.get_title())
    speedups = [ax for ax in axes if "speedup" in ax.get_ylabel()]
    assert (speedups == []) == (kind == "cpu"), [ax.get_ylabel() for ax in axes]


def test_plot_series_in_numeric_order():
    from autofuse.commands.results import _pick_x

    table = [{"problem": f"flash_decode|B={b},D=128,Hkv=8,Hq=64,S={s}|bfloat16|w2", "us": {"bsp": 1.0}}
             for s in (1024, 16384, 262144, 4096, 65536) for b in (1, 8)]
    xd, series = _pick_x(table, None)
    assert xd == "B"
    order = [dict((k, v[1]) for k, v in key[3])["S"] for key in sorted(series)]
    assert order == [1024, 4096, 16384, 65536, 262144]
    coupled = [{"problem": f"ag_gemm|K=64,M={m},N={n},gather=rows|bfloat16|w2", "us": {"bsp": 1.0}}
               for m, n in ((4, 32), (24, 48), (64, 64))]  # the CPU sweep: M and N change together
    xd, series = _pick_x(coupled, None)
    assert xd == "size" and [len(v) for v in series.values()] == [3]


# ---------------------------------------------------------------------------------------------
# safe outputs and read-only databases


def test_fit_writes_to_the_user_data_dir_and_never_replaces(runner, tmp_path):
    db = make_db(tmp_path / "cpu.db", fp=FP)
    res = runner.invoke(app, ["fit", "--db", str(db)])
    assert res.exit_code == 0, res.output
    assert "within 5%" in _flat(res.stdout) and "x bsp" not in res.stdout  # CPU timings: never a speedup
    written = list((tmp_path / "xdg" / "autofuse" / "models").glob("*.json"))
    assert len(written) == 1, written
    machine = FP["gpu_name"].split("(")[1].strip(")").replace("_", "-")
    assert written[0].name == f"cpu-emulation-{machine}-{FP['id']}-eager.json"
    assert "-x0-" not in written[0].name
    before = _digest(written[0])
    res = runner.invoke(app, ["fit", "--db", str(db)])
    assert res.exit_code == 1 and "exists; pass --force" in _flat(res.output) and _digest(written[0]) == before
    res = runner.invoke(app, ["fit", "--db", str(db), "--force"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["fit", "--db", str(db), "--op", "ag_gemm"])  # one op: not where dispatch looks
    assert res.exit_code == 0, res.output
    one_op = written[0].name.replace(".json", "-ag_gemm.json")
    assert [p.name for p in (tmp_path / "autofuse-out").iterdir()] == [one_op]


def test_default_outputs_leave_shipped_files_alone(runner, db, tmp_path):
    """fit and export with default outputs, run inside a copy of the repository, change no shipped file."""
    repo = tmp_path / "repo"
    for sub in ("models", "tuning_db"):
        (repo / sub).mkdir(parents=True)
        for f in (ROOT / sub).iterdir():
            if f.is_file() and f.suffix in (".json", ".csv", ".md"):
                shutil.copy(f, repo / sub / f.name)
    (repo / "autofuse-out").mkdir()
    shutil.copy(db, repo / "autofuse-out" / "autofuse.db")  # the default --db
    before = {p: _digest(p) for p in repo.rglob("*") if p.is_file()}
    os.chdir(repo)
    for args in (["fit"], ["export"], ["export", "--format", "json"], ["show"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
    after = {p: _digest(p) for p in before}
    assert after == before
    assert sorted(p.name for p in (repo / "autofuse-out").iterdir()) == \
        ["autofuse.db", "scaling-eager.csv", "scaling-eager.json", "tuning-eager.csv", "tuning-eager.json"]
    assert not list((repo / "models").glob("cpu-*"))


@pytest.fixture
def unrelated(tmp_path) -> Path:
    path = tmp_path / "app.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users (name) VALUES ('ada')")
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize("command", [["show"], ["export"], ["fit"]])
def test_unrelated_sqlite_file_is_left_byte_identical(runner, unrelated, command):
    before = _digest(unrelated)
    res = runner.invoke(app, [*command, "--db", str(unrelated)])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and str(unrelated) in lines[0], res.output
    assert _digest(unrelated) == before
    assert sorted(p.name for p in unrelated.parent.iterdir() if p.name.startswith("app.db")) == ["app.db"]


def test_tuning_database_is_left_byte_identical(runner, db):
    before = _digest(db)
    assert db.read_bytes()[18] == 2  # WAL mode, as the store writes it
    for args in (["show"], ["export"], ["fit", "--out", "p.json"]):
        assert runner.invoke(app, [*args, "--db", str(db)]).exit_code == 0
    assert _digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]  # no -wal / -shm left beside it


@pytest.mark.parametrize("kind", ["directory", "truncated", "empty", "text", "missing"])
def test_unusable_database_is_one_line(runner, db, tmp_path, kind):
    path = tmp_path / f"{kind}.db"
    if kind == "directory":
        path.mkdir()
    elif kind == "truncated":
        path.write_bytes(db.read_bytes()[:3000])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("not a database at all\n" * 100)
    for command in ("show", "export", "fit"):
        res = runner.invoke(app, [command, "--db", str(path)])
        assert res.exit_code == 1, (command, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], (command, res.output)
        assert "Traceback" not in res.output and not isinstance(res.exception, (AttributeError, sqlite3.Error))


def test_foreign_markup_prints_as_written(runner, tmp_path):
    path = tmp_path / "[/red] and [/foo]" / "x.db"  # folders "[", "red] and [", "foo]"
    path.mkdir(parents=True)
    res = runner.invoke(app, ["show", "--db", str(path)])
    assert res.exit_code == 1 and str(path) in res.output, res.output
    assert "MarkupError" not in res.output


# ---------------------------------------------------------------------------------------------
# bench targets (a fake target module, this one, behind the run/render contract)


def run(options) -> dict:
    """The fake bench target's run: one row per requested variant; 'explode' raises gloo-like text."""
    if options.variants and "explode" in options.variants:
        raise RuntimeError("[/home/ci/gloo/transport.cc:154] Connection closed by peer [/red] [/foo]")
    if options.progress:
        print("[1/1] fake measurement", flush=True)
    return {"rows": [{"case": "a", "us": 1.5, "nan": float("nan")}], "sweep": "tiny", "world": options.world}


def render(result: dict, console) -> None:
    console.print(f"fake table [bold]{len(result['rows'])} row[/bold] [/red]")


DEFAULT_SWEEP = {"cpu": "tiny", "cuda": "tiny"}  # the fake target's default sweep (names the output file)


@pytest.fixture
def fake_target(monkeypatch):
    from autofuse.bench import bench

    monkeypatch.setitem(bench.TARGETS, "fake", __name__)
    monkeypatch.setitem(bench.TARGETS, "ghost", "autofuse.bench.bench_ghost_missing")
    return bench


def test_bench_target_contract(runner, fake_target, tmp_path):
    res = runner.invoke(app, ["bench", "fake", "--world", "3"])
    assert res.exit_code == 0, res.output
    assert "fake table [bold]1 row[/bold] [/red]" in _flat(res.stdout)  # markup off: printed as written
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    path = tmp_path / "autofuse-out" / f"bench-fake-tiny-w3-{date}.json"
    doc = json.loads(path.read_text())
    assert doc["target"] == "fake" and doc["rows"][0]["us"] == 1.5 and doc["rows"][0]["nan"] is None
    assert doc["options"]["world"] == 3 and doc["fingerprint"]["id"] == FP["id"]
    res = runner.invoke(app, ["bench", "fake", "--world", "3"])  # a second run never replaces the first:
    assert res.exit_code == 1 and "exists; pass --force" in _flat(res.output)  # it stops before any work, as
    assert "fake measurement" not in res.output and json.loads(path.read_text()) == doc  # show, fit, export do
    assert not path.with_name(path.stem + "-2.json").exists()
    res = runner.invoke(app, ["bench", "fake", "--out", str(path)])
    assert res.exit_code == 1 and "exists" in res.output
    res = runner.invoke(app, ["bench", "fake", "--json", "--out", "b.json"])  # stdout: the JSON document only
    assert res.exit_code == 0 and json.loads(res.stdout) == json.loads((tmp_path / "b.json").read_text())
    assert not (tmp_path / "docs").exists()


def test_bench_errors_are_one_line(runner, fake_target):
    res = runner.invoke(app, ["bench", "ghost"])
    assert res.exit_code == 1 and res.output.strip() == \
        "bench target 'ghost' is not available in this installation (its module " \
        "autofuse.bench.bench_ghost_missing is missing)"
    res = runner.invoke(app, ["bench", "nonsense"])
    assert res.exit_code == 1 and "unknown bench target 'nonsense'" in _flat(res.output) and "ag_gemm" in res.output
    res = runner.invoke(app, ["bench", "fake", "--variants", "explode"])
    assert res.exit_code == 1 and "[/home/ci/gloo/transport.cc:154]" in res.output and "[/red] [/foo]" in _flat(res.output)
    assert "Traceback" not in res.output and "MarkupError" not in res.output
    res = runner.invoke(app, ["bench", "ag_gemm", "--mode", "graph"])
    assert res.exit_code == 1 and "needs CUDA graphs" in _flat(res.output)
    res = runner.invoke(app, ["bench", "train-layer", "--mode", "graph"])  # hyphenated: the same target
    assert res.exit_code == 1 and "needs CUDA graphs" in _flat(res.output) and "unknown" not in res.output


def test_cpu_op_bench(tmp_path):
    """`autofuse bench gemm_ar` on CPU ranks: a line per measurement, the interpreter note, JSON into
    ./autofuse-out/ of the current directory."""
    env = dict(os.environ, COLUMNS="80")
    cmd = [sys.executable, "-m", "autofuse", "bench", "gemm_ar", "--variants", "bsp", "--limit", "1", "--reps", "2"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^\[1/1\] problem 1/1 gemm_ar\|.* bsp default: eager [0-9.]+ us$", res.stdout, re.M), res.stdout
    assert "not GPU timings" in _flat(res.stdout + res.stderr)
    written = list((tmp_path / "autofuse-out").glob("bench-gemm_ar-cpu-w2-*.json"))
    assert len(written) == 1 and f"wrote {written[0].relative_to(tmp_path)}" in _flat(res.stderr)
    doc = json.loads(written[0].read_text())
    assert doc["op"] == "gemm_ar" and doc["sweep"] == "cpu" and len(doc["rows"]) == 1
    assert "profile" not in doc["rows"][0]  # only `--profile` adds it
    tables = [line for line in res.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(tables) >= 5
    _check_80("\n".join(tables))


# ---------------------------------------------------------------------------------------------
# README


def test_readme_commands_use_existing_options(runner):
    """Every `autofuse CMD --option` the README shows exists in that command's help."""
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"(?:^|\s|`)autofuse ((?:[a-z]+)(?: [^\n`#]*)?)", text)
    assert commands
    for cmd in commands:
        words = cmd.split()
        name = words[0]
        if name not in ("doctor", "tune", "fit", "export", "show", "bench", "merge", "warmup"):
            continue
        help_text = runner.invoke(app, [name, "--help"]).output
        for opt in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
            assert opt in help_text, f"README: `autofuse {cmd}` uses {opt}, which `autofuse {name}` lacks"


def test_readme_names_the_commands_that_take_world_json_out(runner):
    """The README's "`--opt` (`cmd`, ...)" lists name exactly the commands whose help has the option."""
    text = " ".join((ROOT / "README.md").read_text().split())
    commands = ("doctor", "tune", "fit", "export", "show", "bench", "merge", "warmup")
    helps = {c: runner.invoke(app, [c, "--help"]).output for c in commands}
    for opt in ("--world", "--json", "--out"):
        said = re.search(rf"`{opt}[^`]*` \(((?:`[a-z]+`(?:, )?)+)\)", text)
        assert said, f"README does not say which commands take {opt}"
        assert set(re.findall(r"`([a-z]+)`", said.group(1))) == {c for c in commands if opt in helps[c]}, opt


def test_readme_examples_write_where_git_ignores():
    """Files the README's commands write (tune's --db, merge's OUT, --plot, --out, --report) go under the
    git-ignored autofuse-out/, so following the README leaves the checkout as it was (CI checks it too)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()]
    written = [m for line in lines for m in re.findall(r"autofuse merge (\S+)", line)]
    written += [m for line in lines if "autofuse tune" in line for m in re.findall(r"--db (\S+)", line)]
    written += [m for line in lines for m in re.findall(r"--(?:plot|out|report) (\S+)", line)]
    assert len(written) >= 3
    for path in written:
        assert path.startswith("autofuse-out/"), f"README writes {path} outside autofuse-out/"


def test_default_tuning_database_is_git_ignored():
    """What the commands write by default is git-ignored; shipped files are not (their home is apart)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["autofuse-out/autofuse.db", "autofuse-out/autofuse.db-wal", "autofuse-out/autofuse.optuna.db",
             "autofuse-out/mine.db", "autofuse-out/bench-x.json", "tuning_db/autofuse.db"]
    res = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert sorted(res.stdout.split()) == sorted(paths), res.stdout
    res = subprocess.run(["git", "check-ignore", "tuning_db/h200x2.db", "models/x.json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert res.stdout == ""


def test_show_and_export_mark_rows_of_older_op_code_stale(runner, tmp_path):
    """Problems measured only with older code of their op are shown (not hidden) and marked stale, as dispatch
    uses them: predictions confirmed on first use; export says so per record; fit leaves them out."""
    from autofuse.core.op import Problem
    from autofuse.measure.store import Store
    from autofuse.measure.timing import Measurement

    db = make_db(tmp_path / "stale.db")
    old = Problem.make("ag_gemm", "bfloat16", 2, M=512, N=7168, K=8192, gather="rows")
    with Store.open(db) as store:
        store.add([Measurement(old, v, {}, "eager", True, median_us=t, p10_us=t, p90_us=t, min_us=t, reps=3)
                   for v, t in (("bsp", 20.0), ("push", 15.0))], GPU_FP, source="tune", op_digest="older-code")
    res = runner.invoke(app, ["show", "--db", str(db), "--op", "ag_gemm"])
    assert res.exit_code == 0, res.output
    _check_80(res.stdout)
    lines = [line for line in res.stdout.splitlines() if line.startswith("│ 512")]
    assert len(lines) == 1 and "stale" in lines[0], res.stdout
    assert sum("stale" in line for line in res.stdout.splitlines() if line.startswith("│")) == 1
    assert "confirms each on first use" in " ".join(res.stdout.split())
    res = runner.invoke(app, ["export", "--db", str(db), "--format", "json"])
    assert res.exit_code == 0, res.output
    records = json.loads((tmp_path / "autofuse-out" / "tuning-eager.json").read_text())
    assert {r["problem"]: r["stale"] for r in records if r["M"] == 512} == {old.key: True}
    assert not any(r["stale"] for r in records if r["M"] != 512)
    res = runner.invoke(app, ["fit", "--db", str(db), "--out", "p.json"])
    assert res.exit_code == 0 and "left out 1 problems of ag_gemm measured only with older code" in _flat(res.stderr)


def test_show_names_the_other_environments_of_a_merged_database(runner, tmp_path):
    """A database with rows of two machines in one mode: show reads one and says which others it holds and
    how to read them (--fingerprint)."""
    from autofuse.measure.store import Store

    other_fp = dict(GPU_FP, gpu_name="Other GPU", gpu_count=2)
    db = make_db(tmp_path / "merged.db")
    make_db(tmp_path / "other.db", fp=other_fp)
    with Store.open(db) as store, Store.open(tmp_path / "other.db", readonly=True) as other:
        store.merge_from(other)
    res = runner.invoke(app, ["show", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)["eager"]["fingerprint"]
    err = " ".join(res.stderr.split())
    assert "also holds environment" in err and "--fingerprint" in err, err
    hidden = err.split("also holds environment")[1].split()[0].strip(",:(")
    assert hidden != shown
    res = runner.invoke(app, ["show", "--db", str(db), "--json", "--fingerprint", hidden])
    assert res.exit_code == 0 and json.loads(res.stdout)["eager"]["fingerprint"] == hidden, res.output
    assert "also holds" not in res.stderr


def test_policy_fitted_off_the_machine_records_the_code_it_was_fitted_on(runner, tmp_path):
    """A database tuned on a GPU host, fitted elsewhere (a login node, a CPU laptop): the policy records
    today's op digests, those of the rows it read, so dispatch on the tuned host trusts it (not stale), and
    a digest the code no longer has still makes it stale."""
    from autofuse.dispatch.policy import Policy
    from autofuse.measure import environment

    db = make_db(tmp_path / "gpu.db")  # measured on GPU_FP, not this machine
    res = runner.invoke(app, ["fit", "--db", str(db), "--out", "p.json"])
    assert res.exit_code == 0 and "not this machine's" in " ".join(res.stderr.split()), res.output
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["fingerprint"]["ops"] == environment.op_digests()
    here = dict(GPU_FP, ops=environment.op_digests())
    assert Policy.from_dict(data, here, "p.json").stale_ops == {}
    changed = dict(here, ops=dict(here["ops"], ag_gemm="other-code"))
    assert list(Policy.from_dict(data, changed, "p.json").stale_ops) == ["ag_gemm"]


def test_fit_on_stale_rows_only_says_they_are_stale(runner, tmp_path):
    """A database whose every row was measured with older code of its op: fit says so and how to re-tune,
    not that there are no successful measurements."""
    from autofuse.core.op import Problem
    from autofuse.measure.store import Store
    from autofuse.measure.timing import Measurement

    db = tmp_path / "old.db"
    ms = [Measurement(Problem.make("ag_gemm", "bfloat16", 2, M=m, N=7168, K=8192, gather="rows"), v, {}, "eager", True,
                      median_us=t, p10_us=t, p90_us=t, min_us=t, reps=3)
          for m in (64, 1024) for v, t in (("bsp", 20.0), ("push", 15.0))]
    with Store.open(db) as store:
        store.add(ms, GPU_FP, source="tune", op_digest="older-code")
    res = runner.invoke(app, ["fit", "--db", str(db), "--out", "p.json"])
    err = " ".join(res.stderr.split())
    assert res.exit_code == 1 and not (tmp_path / "p.json").exists(), res.output
    assert "no successful" not in err, err
    assert "only measurements of older code of ag_gemm" in err and "re-tune with `autofuse tune`" in err, err


def test_gemm_core_bench_table_at_80_columns_and_no_ratio_on_cpu():
    """The GEMM-core bench table in a log (80 columns, long config texts): nothing cut; the core/torch ratio
    and the target verdict appear for GPU timings only."""
    import io

    from rich.console import Console

    from autofuse.bench import bench_gemm_core

    row = {"M": 16384, "N": 28672, "K": 14336, "mode": "graph", "cublas_us": 13229.41, "core_us": 14001.2,
           "core_vs_cublas": 1.058, "meets_target": False, "configs": [],
           "best_text": "BLOCK_M=128,BLOCK_N=256,BLOCK_K=64,GROUP_M=8,num_warps=8,num_stages=3,TMA,WARP_SPEC"}
    for kind in ("cuda", "cpu"):
        text = io.StringIO()
        bench_gemm_core.render({"rows": [row], "device_kind": kind, "device": "x"},
                               Console(file=text, width=80, markup=False, highlight=False))
        out = text.getvalue()
        _check_80(out)
        assert "13229.4" in out and "14001.2" in out
        assert ("1.06" in out) == (kind == "cuda") and ("NO" in out) == (kind == "cuda")


def test_docs_agree_on_the_policy_search_order_and_name_no_branch():
    """The policy search order is written in three places (models/README.md, the dispatch package's
    docstring, dispatch/policy_files.py's): each names the folders in the order the code searches them. The
    pages that describe today's state (README, docs/results/README) point to no branch: only main lands."""
    import autofuse.dispatch
    import autofuse.dispatch.policy_files as policies

    order = ["AUTOFUSE_MODELS_DIR", "XDG_DATA_HOME", "models/", "share/autofuse/models"]
    texts = {"models/README.md": (ROOT / "models" / "README.md").read_text(),
             "autofuse/dispatch/__init__.py": autofuse.dispatch.__doc__, "policy_files.py": policies.__doc__}
    for name, text in texts.items():
        text = " ".join(text.split())
        at = text.find("AUTOFUSE_POLICY")
        for word in order:  # each after the one before
            at = text.find(word, at + 1)
            assert at >= 0, f"{name} does not name {word} after {order[:order.index(word)]}"
    for page in ("README.md", "docs/results/README.md"):
        assert not re.findall(r"branch `[^`]+`", (ROOT / page).read_text()), page


# ---------------------------------------------------------------------------------------------
# files that are not what they seem (issue 31): devices, FIFOs, damaged or modified databases


def _not_regular(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.out"
    os.mkfifo(fifo)
    link = tmp_path / "null.out"
    link.symlink_to(os.devnull)
    return {"fifo": fifo, "link to a device": link}


def _still(kind: str, path: Path) -> bool:
    import stat

    return stat.S_ISFIFO(path.lstat().st_mode) if kind == "fifo" else path.is_symlink() and not path.resolve().is_file()


def test_outputs_that_are_not_regular_files_are_never_replaced(runner, db, tmp_path):
    """--out / --plot naming a FIFO or a link to a device fail in one line, --force or not; the FIFO and the
    link (and the device behind it) stay as they were."""
    for kind, path in _not_regular(tmp_path).items():
        for args in (["fit", "--db", str(db), "--out", str(path)], ["show", "--db", str(db), "--plot", str(path)]):
            for force in ([], ["--force"]):
                res = runner.invoke(app, [*args, *force])
                assert res.exit_code == 1, (kind, args, force, res.output)
                assert "not a regular file" in _flat(res.output) and "Traceback" not in res.output, res.output
                assert _still(kind, path), (kind, args, force)


def test_damaged_database_given_to_tune_or_merge_is_untouched(runner, db, tmp_path):
    """tune --db and merge OUT with a database whose later pages are damaged: one line naming it, before any
    rank starts, and the file stays byte-identical."""
    damaged = tmp_path / "damaged.db"
    shutil.copy(db, damaged)
    con = sqlite3.connect(damaged)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    data = bytearray(damaged.read_bytes())
    data[-2 * 4096:] = b"\xa5" * (2 * 4096)
    damaged.write_bytes(bytes(data))
    before = _digest(damaged)
    for args in (["tune", "--db", str(damaged), "--op", "gemm_ar", "--trials", "1"],
                 ["merge", str(damaged), str(db)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert "corrupt" in res.output and str(damaged) in res.output and "Traceback" not in res.output, res.output
        assert _digest(damaged) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("damaged")) == ["damaged.db"]


@pytest.mark.parametrize("column, value", [("problem", "ag_gemm|M=x|bfloat16"), ("config", "not json"),
                                           ("median_us", "fast"), ("median_us", -5.0), ("median_us", float("inf")),
                                           ("problem", "gemm_ar|K=8192,M=128,N=7168|bfloat16|w2")])
def test_rows_modified_outside_autofuse_are_one_line(runner, db, tmp_path, column, value):
    """show, export and fit name the row and stop; merge copies nothing from such an input (OUT untouched)."""
    path = tmp_path / "modified.db"
    shutil.copy(db, path)
    with sqlite3.connect(path) as con:
        con.execute(f"UPDATE measurements SET {column} = ?", [value])
    out = tmp_path / "merged.db"
    shutil.copy(db, out)
    before = _digest(out)
    res = runner.invoke(app, ["merge", str(out), str(path)])
    assert res.exit_code == 1 and "outside autofuse" in _flat(res.output) and "Traceback" not in res.output, res.output
    assert _digest(out) == before
    for command in ("show", "export", "fit"):
        res = runner.invoke(app, [command, "--db", str(path)])
        assert res.exit_code == 1, (command, res.output)
        assert str(path) in res.output and "outside autofuse" in _flat(res.output), (command, res.output)
        assert "Traceback" not in res.output and not isinstance(res.exception, (ValueError, TypeError)), res.output


def test_merge_into_itself_leaves_it_untouched(runner, db, tmp_path):
    """OUT named as an input (by its path or through a link) is skipped; with no other input OUT is not even
    opened, so not one byte of it changes (its meta row included)."""
    out = tmp_path / "out.db"
    shutil.copy(db, out)
    link = tmp_path / "link.db"
    link.symlink_to(out)
    before = _digest(out)
    for args in (["merge", str(out), str(out)], ["merge", str(out), str(link)], ["merge", "--json", str(out), str(out)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "it is the output" in " ".join(res.output.split()), (args, res.output)
        assert _digest(out) == before, args
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out.db"]


def test_a_dangling_db_link_is_refused(runner, db, tmp_path):
    """tune --db and merge's OUT through a symbolic link to a missing file: one line, and the link's target is
    never created (SQLite would create it through the link)."""
    target = tmp_path / "elsewhere" / "target.db"
    target.parent.mkdir()
    link = tmp_path / "link.db"
    link.symlink_to(target)
    for args in (["merge", str(link), str(db)], ["tune", "--db", str(link), "--op", "gemm_ar", "--trials", "1"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert "symbolic link" in _flat(res.output) and "does not exist" in _flat(res.output), (args, res.output)
        assert "Traceback" not in res.output, res.output
        assert not target.exists() and link.is_symlink(), args
    assert list(target.parent.iterdir()) == []
