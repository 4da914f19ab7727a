"""`autofuse fit`, `autofuse export`, `autofuse show`: from the tuning store to a policy and tables."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()
notes = Console(stderr=True)  # notes and errors: stdout stays machine-readable with --json
DEFAULT_DB = Path("tuning_db/autofuse.db")
ModeOpt = typer.Option("graph", "--mode", help="Timing mode of the measurements: graph or eager.")
DbOpt = typer.Option(DEFAULT_DB, "--db", help="The tuning database.")
FpOpt = typer.Option(None, "--fingerprint", help="Environment id to read (default: this machine's if it has "
                     "rows in the mode, else the one with the most rows).")


def _fail(text: str) -> None:
    notes.print(f"[red]{text}[/]")
    raise typer.Exit(1)


def load_rows(db: Path, mode: str, fingerprint: str | None, op: str | None = None) -> tuple[list[dict], dict]:
    """Best row per (problem, variant) of one environment, and that environment's fingerprint dict."""
    from autofuse import environment
    from autofuse.store import ALL, Store

    if mode not in ("graph", "eager"):
        _fail(f"--mode must be graph or eager, not {mode!r}")
    if not db.exists():
        _fail(f"no tuning database at {db}: run `autofuse tune` first, or pass --db")
    store = Store(db)
    try:
        here = environment.fingerprint()
        if fingerprint is None:
            counts: dict[str, int] = {}
            for r in store.best(op, mode, fingerprint_id=ALL):
                counts[r["fingerprint"]] = counts.get(r["fingerprint"], 0) + 1
            if not counts:
                _fail(f"{db} has no successful {mode}-mode measurements" + (f" of {op}" if op else ""))
            fingerprint = here["id"] if here["id"] in counts else max(sorted(counts), key=counts.get)
            if fingerprint != here["id"]:
                notes.print(f"[yellow]reading environment {fingerprint} ({counts[fingerprint]} rows), not this "
                              f"machine's ({here['id']})[/]")
        rows = store.best(op, mode, fingerprint_id=fingerprint)
        if fingerprint == here["id"]:
            fp = dict(here)
        else:
            fp = store.environment(fingerprint) or {"id": fingerprint}
            fp.pop("created_at", None)
    finally:
        store.close()
    if not rows:
        _fail(f"{db} has no successful {mode}-mode measurements in environment {fingerprint}")
    return rows, fp


def problem_table(rows: list[dict]) -> list[dict]:
    """Per problem: latency and config per variant, the best non-bound variant, BSP and the bound."""
    by: dict[str, dict] = {}
    for r in rows:
        e = by.setdefault(r["problem"], {"op": r["op"], "problem": r["problem"], "us": {}, "configs": {},
                                         "bound_pieces": {}})
        v, t = r["variant"], r["median_us"]
        if v == "bound":
            e["bound"] = t
        elif v.startswith("bound"):
            e["bound_pieces"][v] = t
        elif v not in e["us"] or t < e["us"][v]:
            e["us"][v], e["configs"][v] = t, r["config"]
    out = []
    for key in sorted(by, key=_sort_key):
        e = by[key]
        if "bound" not in e and e["bound_pieces"]:
            e["bound"] = max(e["bound_pieces"].values())
        e.setdefault("bound", None)
        if e["us"]:
            e["best"] = min(sorted(e["us"]), key=lambda v, u=e["us"]: u[v])
            e["best_us"] = e["us"][e["best"]]
        else:
            e["best"], e["best_us"] = None, None
        e["bsp_us"] = e["us"].get("bsp")
        e["speedup_vs_bsp"] = e["bsp_us"] / e["best_us"] if e["bsp_us"] and e["best_us"] else None
        out.append(e)
    return out


def _sort_key(key: str) -> tuple:
    from autofuse.op import Problem

    p = Problem.from_key(key)
    return (p.op, p.dtype, p.world, tuple((k, str(v).zfill(12)) for k, v in p.dims))


def _fmt(x: Any, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------------------


def fit(
    db: Path = DbOpt,
    mode: str = ModeOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Policy JSON to write (default models/<gpu>-x<n>-<fingerprint>-<mode>.json)."),
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Fit only this op."),
    folds: int = typer.Option(5, help="Folds (by problem) of the held-out evaluation."),
    json_out: bool = typer.Option(False, "--json", help="Print the fit report as JSON instead of tables."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write the fit report as JSON here."),
) -> None:
    """Fit the dispatch policy on the store (gbr regressor vs tree classifier, held-out), write it as JSON."""
    from autofuse import policy

    rows, fp = load_rows(db, mode, fingerprint, op)
    result = policy.fit(rows, fp, mode, folds=folds)
    out = out or Path("models") / policy.file_name(fp, mode)
    policy.Policy(result.data).save(out)
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result.report, indent=1, sort_keys=True) + "\n")
    if json_out:
        print(json.dumps(result.report, indent=1, sort_keys=True))
        return
    for name, rep in result.report["ops"].items():
        _print_fit(name, rep)
    console.print(f"policy written to [bold]{out}[/] (fingerprint {fp.get('id')}, {mode} mode)")


def _print_fit(name: str, rep: dict) -> None:
    title = f"{name}: {rep['problems']} tuned problems, variants {', '.join(rep['variants'])}"
    if "models" not in rep:
        console.print(f"[bold]{title}[/]\n  {rep['why']}")
        return
    t = Table(title=f"{title}; held out: {rep['folds']} folds by problem")
    for col in ("", "within 5% of best", "latency / oracle", "speedup vs bsp", "worst vs bsp", "correct",
                "wrong", "unsure", "error (x)"):
        t.add_column(col, justify="left" if not col else "right")
    rows = [(m, rep["models"][m]) for m in rep["models"]] + [(f"always {b}", rep["baselines"][b]) for b in ("bsp", "oracle")]
    for label, r in rows:
        margin = r.get("margin")
        t.add_row(label + (" (kept)" if label == rep["kept"] else ""), f"{r['within_5pct']:.0%}",
                  _fmt(r["geomean_vs_oracle"], 3), _fmt(r["speedup_vs_bsp"], 3), _fmt(r["worst_vs_bsp"], 3),
                  str(r["correct"]), str(r["wrong"]), str(r["unsure"]),
                  _fmt(math.exp(margin), 3) if margin is not None else ("inf" if label in rep["models"] else "-"))
    console.print(t)
    console.print(f"  {rep['why']}")
    if rep["skipped"]:
        console.print(f"  skipped {len(rep['skipped'])} problems: {'; '.join(rep['skipped'][:5])}")


def export(
    fmt: str = typer.Option("csv", "--format", help="csv or json."),
    db: Path = DbOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Output file (default tuning_db/tuning-<mode>.<format>)."),
    mode: str = ModeOpt,
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Export only this op."),
) -> None:
    """Write the tuning table: per problem, the chosen variant and config, its latency and speedup vs BSP."""
    if fmt not in ("csv", "json"):
        _fail(f"--format must be csv or json, not {fmt!r}")
    rows, fp = load_rows(db, mode, fingerprint, op)
    table = problem_table(rows)
    variants = sorted({v for e in table for v in e["us"]})
    records = []
    from autofuse.op import Problem

    for e in table:
        p = Problem.from_key(e["problem"])
        rec: dict[str, Any] = {"op": p.op, "problem": e["problem"], "dtype": p.dtype, "world": p.world,
                               **dict(p.dims), "mode": mode, "fingerprint": fp.get("id"), "variant": e["best"],
                               "config": e["configs"].get(e["best"], {}), "latency_us": e["best_us"],
                               "bsp_us": e["bsp_us"], "speedup_vs_bsp": e["speedup_vs_bsp"], "bound_us": e["bound"]}
        rec.update({f"{v}_us": e["us"].get(v) for v in variants})
        records.append(rec)
    out = out or Path("tuning_db") / f"tuning-{mode}.{fmt}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        out.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    else:
        fields: list[str] = []
        for rec in records:
            fields += [k for k in rec if k not in fields]
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=fields, restval="")
        w.writeheader()
        for rec in records:
            w.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else ("" if v is None else v)
                        for k, v in rec.items()})
        out.write_text(buf.getvalue())
    console.print(f"{len(records)} problems written to [bold]{out}[/]")


def show(
    db: Path = DbOpt,
    mode: str = ModeOpt,
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Show only this op."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw latency and speedup vs M per variant (PNG)."),
    x: Optional[str] = typer.Option(None, "--x", help="Dimension on the plot's x axis (default M, else B)."),
) -> None:
    """The tuning table per op: latency per variant, the best, speedup vs BSP, the bound."""
    rows, fp = load_rows(db, mode, fingerprint, op)
    table = problem_table(rows)
    for name in sorted({e["op"] for e in table}):
        entries = [e for e in table if e["op"] == name]
        variants = ["bsp"] + sorted({v for e in entries for v in e["us"]} - {"bsp"})
        t = Table(title=f"{name}: {mode} mode, us per call (rank-max median), environment {fp.get('id')}")
        t.add_column("problem")
        for v in variants:
            t.add_column(v, justify="right")
        for col in ("best", "x bsp", "bound"):
            t.add_column(col, justify="right")
        for e in entries:
            t.add_row(e["problem"], *[_fmt(e["us"].get(v)) for v in variants], e["best"] or "-",
                      _fmt(e["speedup_vs_bsp"], 2), _fmt(e["bound"]))
        console.print(t)
    if plot:
        draw(table, plot, x, mode)


def draw(table: list[dict], path: Path, x: str | None, mode: str) -> None:
    """Per op and series (the problem without its x dimension): latency and speedup vs x per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("--plot needs matplotlib, which is not installed: pip install 'autofuse[plot]' (or matplotlib)")
    from autofuse.op import Problem

    series: dict[str, list[tuple[float, dict]]] = {}
    for e in table:
        p = Problem.from_key(e["problem"])
        dims = dict(p.dims)
        xd = x or ("M" if "M" in dims else "B" if "B" in dims else next(k for k, v in dims.items() if isinstance(v, int)))
        if xd not in dims:
            continue
        rest = ",".join(f"{k}={v}" for k, v in p.dims if k != xd)
        series.setdefault(f"{p.op} {rest} {p.dtype} w{p.world}|{xd}", []).append((float(dims[xd]), e))
    if not series:
        _fail("nothing to plot: no problem has the x dimension")
    keys = sorted(series)[:12]
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 3.6 * len(keys)), squeeze=False)
    for (ax_t, ax_s), key in zip(axes, keys):
        label, xd = key.rsplit("|", 1)
        pts = sorted(series[key], key=lambda p: p[0])
        xs = [p[0] for p in pts]
        variants = ["bsp"] + sorted({v for _, e in pts for v in e["us"]} - {"bsp"})
        for v in variants:
            ys = [e["us"].get(v, math.nan) for _, e in pts]
            sp = [(e["bsp_us"] or math.nan) / e["us"].get(v, math.nan) for _, e in pts]
            style = {"color": "black", "linewidth": 2} if v == "bsp" else {}
            ax_t.plot(xs, ys, marker="o", label=v, **style)
            ax_s.plot(xs, sp, marker="o", label=v, **style)
        bounds = [e["bound"] if e["bound"] else math.nan for _, e in pts]
        if any(b == b for b in bounds):
            ax_t.plot(xs, bounds, linestyle="--", color="gray", label="bound")
            ax_s.plot(xs, [(e["bsp_us"] or math.nan) / b for (_, e), b in zip(pts, bounds)], linestyle="--",
                      color="gray", label="bound")
        for ax in (ax_t, ax_s):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xd)
            ax.grid(True, alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"us per call ({mode})")
        ax_s.set_ylabel("speedup vs bsp")
        ax_t.set_title(label, fontsize=9)
        ax_s.legend(fontsize=7)
    if len(series) > len(keys):
        fig.suptitle(f"first {len(keys)} of {len(series)} series (filter with --op)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"plot written to [bold]{path}[/]")


def register(app: typer.Typer) -> None:
    app.command("fit")(fit)
    app.command("export")(export)
    app.command("show")(show)
