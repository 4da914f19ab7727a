"""`autofuse fit`, `autofuse export`, `autofuse show`: from the tuning store to a policy and tables.

All three open the database read-only (nothing is created or converted; a file that is not an
autofuse database is one line naming it and the cause) and, without `--mode`, read every timing
mode the database holds (CPU tuning records eager only) and say so. Outputs never replace an
existing file unless `--force`; by default `fit` writes to the user data directory that dispatch
searches (`autofuse.core.settings.user_models_dir()`) and `export` to ./autofuse-out/, never over the
shipped `models/` or `tuning_db/` files.

Strong scaling: where the database holds the same op and global sizes (an op's per-rank dims, e.g.
ag_gemm's N, times the world size) at several world sizes, `show` and `export` add a table per op: per world size the best
variant and its latency, and the speedup over the smallest world size; `show --plot` draws it.
"""
from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from pathlib import Path
from typing import Any, Optional

import typer

from autofuse.core import modes
from autofuse.core.keys import parse_key
from autofuse.measure.compare import interpreted
from autofuse.bench.tables import fmt, print_problems, print_split_table, problem_sort_key, problem_table, split_problems
from autofuse.commands._common import OutputExists, check_new, fail, missing_db, note, order_modes, out, write_new
from autofuse.core.settings import DEFAULT_DB, OUT_DIR

ModeOpt = typer.Option(None, "--mode", help="Timing mode: graph or eager (default: every mode the database holds).")
DbOpt = typer.Option(DEFAULT_DB, "--db", help="The tuning database (opened read-only).")
FpOpt = typer.Option(None, "--fingerprint", help="Environment id to read (default: this machine's if it has "
                     "rows in the mode, else the one with the most rows).")
ForceOpt = typer.Option(False, "--force", help="Replace output files that exist.")


# ---------------------------------------------------------------------------------------------
# reading the store


def _open(db: Path) -> Any:
    from autofuse.measure.store import Store, StoreError

    if not db.exists():
        missing_db(db)
    try:
        return Store.open(db, readonly=True)
    except StoreError as exc:
        fail(str(exc).strip().splitlines()[0] if str(exc).strip() else f"{db}: cannot be opened")


def load(db: Path, mode: str | None, fingerprint: str | None, op: str | None = None,
         stale: bool = True) -> list[tuple[str, list, dict]]:
    """Per timing mode to read: (mode, best row per (problem, variant) of one environment, its fingerprint).

    Without `mode`: every mode the database holds, with a note saying so. Rows of today's code of
    each op come first; with `stale`, a problem measured only with older code of its op gets the rows
    of its newest older code, marked `stale` (dispatch uses such entries as predictions, confirmed on
    first use); without it (fit) they are left out, with a note.
    """
    import sqlite3

    from autofuse.measure.store import StoreError

    if mode is not None and mode not in modes.MODES:
        fail(f"--mode must be graph or eager, not {mode!r}")
    store = _open(db)
    try:
        return _load(store, db, mode, fingerprint, op, stale)
    except (StoreError, sqlite3.Error) as exc:
        fail(f"{db}: cannot be read ({type(exc).__name__}: {exc})")
    finally:
        store.close()


def _with_stale(store: Any, rows: list[dict], op: str | None, mode: str, fp_id: str,
                keep: bool) -> tuple[list[dict], dict[str, int]]:
    """`rows` (today's code) plus, per problem they lack, the rows of the newest older code of its op
    (marked stale) if `keep`; else `rows` and a note of what was left out. Also {op: problems left out}."""
    from autofuse.measure import environment

    now = environment.op_digests()
    covered = {r["problem"] for r in rows}
    added: list[dict] = []
    left: dict[str, int] = {}
    for version in store.code_versions(op, mode, fp_id):
        if now.get(version["op"]) in (None, version["op_digest"]):
            continue  # today's code, or an op this install does not know (read as it is)
        older = [r for r in store.best(version["op"], mode, fingerprint_id=fp_id, op_digest=version["op_digest"])
                 if r["problem"] not in covered]
        for key in {r["problem"] for r in older}:
            covered.add(key)
            left[version["op"]] = left.get(version["op"], 0) + 1
        added += [dict(r, stale=True) for r in older]
    if left and not keep:
        note(f"{mode} mode: left out {', '.join(f'{n} problems of {o}' for o, n in sorted(left.items()))} measured "
             "only with older code of the op (re-tune them)")
        return rows, left
    return rows + added, {}


def _load(store: Any, db: Path, mode: str | None, fingerprint: str | None, op: str | None, stale: bool) -> list:
    from autofuse.measure import environment
    from autofuse.measure.store import ALL

    held = order_modes(store.modes())
    if mode is not None:
        if mode not in held:
            hint = f"; it holds {', '.join(held)} mode: pass --mode {held[0]}" if held else ""
            fail(f"{db} has no {mode}-mode measurements{hint}")
        modes = [mode]
    else:
        if not held:
            fail(f"{db} holds no measurements: run `autofuse tune` first")
        modes = held
        note(f"--mode not given: reading the {' and '.join(modes)} mode{'s' if len(modes) > 1 else ''} "
             f"that {db} holds")
    here = environment.fingerprint()
    found = []
    older: dict[str, int] = {}  # op: problems left out because only older code of the op measured them
    for m in modes:
        fp_id = fingerprint
        if fp_id is None:
            pairs: dict[str, set] = {}  # per environment: its (problem, variant) pairs measured OK, any code
            for r in store.measurements(op, m, fingerprint_id=ALL, op_digest=ALL, ok=True):
                pairs.setdefault(r["fingerprint"], set()).add((r["problem"], r["variant"]))
            counts = {fp: len(p) for fp, p in pairs.items()}
            if not counts:
                note(f"{db} has no successful {m}-mode measurements" + (f" of {op}" if op else ""))
                continue
            fp_id = here["id"] if here["id"] in counts else max(sorted(counts), key=counts.get)
            if fp_id != here["id"]:
                note(f"{m} mode: reading environment {fp_id} ({counts[fp_id]} rows), not this machine's ({here['id']})")
            others = [f"{e} ({counts[e]} rows)" for e in sorted(counts, key=lambda e: (-counts[e], e)) if e != fp_id]
            if others:
                note(f"{m} mode: {db} also holds environment{'s' if len(others) > 1 else ''} {', '.join(others)}, "
                     "not read: pass --fingerprint ID to read one")
        rows, left = _with_stale(store, store.best(op, m, fingerprint_id=fp_id), op, m, fp_id, stale)
        for name, n in left.items():
            older[name] = max(older.get(name, 0), n)
        if not rows:
            if left:
                continue  # _with_stale said what was left out and why
            note(f"{db} has no successful {m}-mode measurements in environment {fp_id}" + (f" of {op}" if op else ""))
            continue
        if fp_id == here["id"]:
            fp = dict(here)
        else:
            fp = dict(store.environment(fp_id) or {"id": fp_id})
            fp.pop("created_at", None)
            if not stale:  # the rows read are today's code of each op: a policy fitted off the machine says so
                fp["ops"] = environment.op_digests()
        found.append((m, rows, fp))
    if not found and older:
        fail(f"{db} holds only measurements of older code of {', '.join(sorted(older))} (the op changed since): "
             f"fit uses today's code only; re-tune with `autofuse tune{' --op ' + op if op else ''}`")
    if not found:
        fail(f"{db} has no successful measurements to use" + (f" of {op}" if op else ""))
    return found


# ---------------------------------------------------------------------------------------------
# tables


def scaling_sizes(key: str) -> tuple[str, int]:
    """('op|global dims|dtype', world) of a problem key: the global sizes that strong scaling compares
    across world sizes (an op's `per_rank` dims times the world; an op this install does not know
    keeps its dims as they are)."""
    from autofuse.core import registry
    from autofuse.core.op import Problem, global_sizes

    problem = Problem.from_key(key)
    try:
        per_rank = registry.get(problem.op).per_rank
    except (KeyError, ImportError):
        per_rank = ()
    return global_sizes(problem, per_rank), problem.world


def scaling_table(table: list[dict]) -> list[dict]:
    """Strong scaling: per op and global sizes (`scaling_sizes`) measured at two or more world
    sizes, per world size the best variant, its latency, BSP's, and the speedup over the smallest world size
    (None for interpreter timings)."""
    from autofuse.measure.compare import ratio

    groups: dict[str, dict[int, dict]] = {}
    for e in table:
        if e["best_us"] is None:
            continue
        sizes, world = scaling_sizes(e["problem"])
        groups.setdefault(sizes, {})[world] = e
    rows = []
    for sizes in sorted(groups, key=lambda s: problem_sort_key(s + "|")):
        per = groups[sizes]
        if len(per) < 2:
            continue
        worlds = sorted(per)
        base = per[worlds[0]]["best_us"]
        rows.append({"op": parse_key(sizes).op, "sizes": sizes, "worlds": worlds, "smallest_world": worlds[0],
                     "per_world": {str(w): {"variant": per[w]["best"], "us": per[w]["best_us"],
                                            "bsp_us": per[w]["bsp_us"], "problem": per[w]["problem"],
                                            "speedup_vs_smallest": None if per[w]["interpreted"]
                                            else ratio(base, per[w]["best_us"])} for w in worlds}})
    return rows


def _print_scaling(scaling: list[dict], mode: str) -> None:
    for name in sorted({s["op"] for s in scaling}):
        entries = [s for s in scaling if s["op"] == name]
        worlds = sorted({w for s in entries for w in s["worlds"]})
        key_cols, cells, fixed = split_problems([s["sizes"] + "|" for s in entries])
        cols: list[str] = []
        for w in worlds:
            cols += [f"w{w} best", f"w{w} us"] + ([f"w{w} speedup"] if w != worlds[0] else [])
        body = []
        for s in entries:
            row = list(cells[s["sizes"] + "|"])
            for w in worlds:
                pw = s["per_world"].get(str(w))
                row += [pw["variant"] if pw else "-", fmt(pw["us"]) if pw else "-"]
                if w != worlds[0]:
                    row.append(fmt(pw["speedup_vs_smallest"], 2) if pw and s["smallest_world"] == worlds[0] else "-")
            body.append(row)
        print_split_table(out, f"{name} {fixed}: strong scaling (global sizes), {mode} mode: best variant and us per "
                          f"call per world size; speedup = w{worlds[0]} us / wN us", key_cols, cols, body)


# ---------------------------------------------------------------------------------------------
# fit


def fit(
    db: Path = DbOpt,
    mode: Optional[str] = ModeOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Policy JSON to write (default: "
                                            "<user data dir>/autofuse/models/<gpu>-x<n>-<fingerprint>-<mode>.json, "
                                            "where dispatch finds it; $XDG_DATA_HOME or ~/.local/share; with --op: "
                                            "./autofuse-out/<that name>-<op>.json)."),
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Fit only this op."),
    folds: int = typer.Option(5, min=2, help="Folds (by problem) of the held-out evaluation."),
    json_out: bool = typer.Option(False, "--json", help="Print the fit report as JSON instead of tables "
                                  "(several modes: an object keyed by mode)."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write the fit report as JSON here."),
    force: bool = ForceOpt,
) -> None:
    """Fit the dispatch policy on the store (gbr regressor vs tree classifier, held-out), write it as JSON."""
    from autofuse.core.settings import user_models_dir
    from autofuse.dispatch.policy import Policy, file_name

    found = load(db, mode, fingerprint, op, stale=False)
    if (out_path or report) and len(found) > 1:
        fail(f"{db} holds {' and '.join(m for m, _, _ in found)} measurements and --out/--report name one file: "
             "add --mode to fit one of them")
    def default(fp: dict, m: str) -> Path:
        if op:  # a one-op policy never lands where dispatch looks for whole-machine policies
            return OUT_DIR / file_name(fp, m).replace(".json", f"-{op}.json")
        return user_models_dir() / file_name(fp, m)

    targets = [(m, rows, fp, out_path or default(fp, m)) for m, rows, fp in found]
    check_new([t[3] for t in targets] + ([report] if report else []), force)
    from autofuse.tuning import fit as fitting

    reports = {}
    for m, rows, fp, path in targets:
        result = fitting.fit(rows, fp, m, folds=folds)
        try:
            write_new(path, Policy(result.data).to_json(), force)
        except (OutputExists, ValueError) as exc:
            fail(str(exc))
        reports[m] = result.report
        if not json_out:
            for name, rep in result.report["ops"].items():
                _print_fit(name, rep, m, interpreted(fp.get("device_kind")))
        where = ("dispatch finds it there on this machine" if path.parent == user_models_dir()
                 else f"use it with AUTOFUSE_POLICY={path}")
        note(f"{m}-mode policy written to {path} (fingerprint {fp.get('id')}); {where}", style="green")
    if report:
        try:
            write_new(report, json.dumps(reports[targets[0][0]], indent=1, sort_keys=True) + "\n", force)
        except OutputExists as exc:
            fail(str(exc))
    if json_out:
        doc = reports[targets[0][0]] if len(reports) == 1 else reports
        print(json.dumps(doc, indent=1, sort_keys=True))


def _print_fit(name: str, rep: dict, mode: str, interp: bool = False) -> None:
    """The held-out evaluation of one op's models; its speedups over BSP only for GPU timings."""
    title = f"{name} ({mode} mode): {rep['problems']} tuned problems, variants {', '.join(rep['variants'])}"
    if "models" not in rep:
        out.print(title, style="bold")
        out.print(f"  {rep['why']}")
        return
    speed = [] if interp else ["x bsp", "worst / bsp"]
    cols = ["within 5%", "t / oracle", *speed, "correct", "wrong", "unsure", "margin (x)"]
    body = []
    entries = [(m, rep["models"][m]) for m in rep["models"]] + \
        [(f"always {b}", rep["baselines"][b]) for b in ("bsp", "oracle")]
    for label, r in entries:
        margin = r.get("margin")
        body.append([label + (" (kept)" if label == rep["kept"] else ""), f"{r['within_5pct']:.0%}",
                     fmt(r["geomean_vs_oracle"], 3),
                     *([] if interp else [fmt(r["speedup_vs_bsp"], 3), fmt(r["worst_vs_bsp"], 3)]), str(r["correct"]), str(r["wrong"]), str(r["unsure"]),
                     fmt(math.exp(margin), 3) if margin is not None else ("inf" if label in rep["models"] else "-")])
    print_split_table(out, f"{title}; held out: {rep['folds']} folds by problem", ["model"], cols, body)
    out.print(f"  {rep['why']}")
    if rep["skipped"]:
        out.print(f"  skipped {len(rep['skipped'])} problems: {'; '.join(rep['skipped'][:5])}")


# ---------------------------------------------------------------------------------------------
# export


def _records(table: list[dict], mode: str, fp_id: str) -> list[dict]:
    """One record per problem: the best variant, its config and latency, and the numbers of
    autofuse.measure.compare (speedups empty for interpreter timings; `timing` says which); `timed_eager`: the
    variants (comma-separated) timed eagerly in graph mode, since they cannot be captured."""
    from autofuse.core.op import Problem

    variants = sorted({v for e in table for v in e["us"]})
    records = []
    for e in table:
        p = Problem.from_key(e["problem"])
        rec: dict[str, Any] = {"op": p.op, "problem": e["problem"], "dtype": p.dtype, "world": p.world,
                               **dict(p.dims), "mode": mode, "fingerprint": fp_id, "variant": e["best"],
                               "config": e["configs"].get(e["best"], {}), "latency_us": e["best_us"],
                               "bsp_us": e["bsp_us"], "speedup_vs_bsp": e["speedup_vs_bsp"],
                               "alternative": e["alternative"], "alternative_us": e["alternative_us"],
                               "speedup_vs_alternative": e["speedup_vs_alternative"],
                               "own": e["own"], "own_us": e["own_us"],
                               "own_vs_alternative": e["own_vs_alternative"],
                               "bound_us": e.get("bound_us"), "ceiling": e["ceiling"],
                               "timing": "cpu-interpreter" if e["interpreted"] else "gpu",
                               "stale": bool(e.get("stale")), "unconfirmed": bool(e.get("unconfirmed")),
                               "unconfirmed_alt": bool(e.get("unconfirmed_alt")),
                               "timed_eager": ",".join(sorted(v for v, x in e.get("timed_eager", {}).items() if x))}
        rec.update({f"{v}_us": e["us"].get(v) for v in variants})
        records.append(rec)
    return records


def _scaling_records(scaling: list[dict], mode: str, fp_id: str) -> list[dict]:
    from autofuse.core.op import Problem

    records = []
    for s in scaling:
        for w in s["worlds"]:
            pw = s["per_world"][str(w)]
            p = Problem.from_key(pw["problem"])
            records.append({"op": p.op, "sizes": s["sizes"], "dtype": p.dtype, **dict(p.dims), "mode": mode,
                            "fingerprint": fp_id, "world": w, "variant": pw["variant"], "latency_us": pw["us"],
                            "bsp_us": pw["bsp_us"], "smallest_world": s["smallest_world"],
                            "speedup_vs_smallest_world": pw["speedup_vs_smallest"]})
    return records


def _serialise(records: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(records, indent=1, sort_keys=True) + "\n"
    fields: list[str] = []
    for rec in records:
        fields += [k for k in rec if k not in fields]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, restval="")
    w.writeheader()
    for rec in records:
        w.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else ("" if v is None else v)
                    for k, v in rec.items()})
    return buf.getvalue()


def export(
    fmt: str = typer.Option("csv", "--format", help="csv or json."),
    db: Path = DbOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Output file, every mode read in one file "
                                            "(default: ./autofuse-out/tuning-<mode>.<format>, one per mode); "
                                            "the strong-scaling table goes beside it as <name>-scaling.<format>."),
    mode: Optional[str] = ModeOpt,
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Export only this op."),
    force: bool = ForceOpt,
) -> None:
    """Write the tuning table (per problem: the best variant and config, its latency and speedup vs BSP) and,
    where several world sizes were measured, the strong-scaling table."""
    if fmt not in ("csv", "json"):
        fail(f"--format must be csv or json, not {fmt!r}")
    found = load(db, mode, fingerprint, op)
    files: dict[Path, tuple[str, list[dict]]] = {}  # path -> (what it holds, records)
    for m, rows, fp in found:
        table = problem_table(rows, interpreted(fp.get("device_kind")))
        main = out_path or OUT_DIR / f"tuning-{m}.{fmt}"
        side = main.with_name(f"{main.stem}-scaling{main.suffix}") if out_path else OUT_DIR / f"scaling-{m}.{fmt}"
        files.setdefault(main, ("problems", []))[1].extend(_records(table, m, fp.get("id")))
        scaling = _scaling_records(scaling_table(table), m, fp.get("id"))
        if scaling:
            files.setdefault(side, ("strong-scaling rows", []))[1].extend(scaling)
    check_new(list(files), force)
    for path, (what, records) in files.items():
        try:
            write_new(path, _serialise(records, fmt), force)
        except OutputExists as exc:
            fail(str(exc))
        out.print(f"{len(records)} {what} written to {path}")


# ---------------------------------------------------------------------------------------------
# show


def show(
    db: Path = DbOpt,
    mode: Optional[str] = ModeOpt,
    fingerprint: Optional[str] = FpOpt,
    op: Optional[str] = typer.Option(None, "--op", help="Show only this op."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw latency and speedup per variant, and the "
                                        "strong scaling, into this PNG (needs matplotlib: "
                                        "pip install 'autofuse[plot]')."),
    x: Optional[str] = typer.Option(None, "--x", help="Dimension on the plot's x axis (default M, else B, else "
                                    "the one giving the most points per series)."),
    json_out: bool = typer.Option(False, "--json", help="Print the tables as JSON instead."),
    force: bool = ForceOpt,
) -> None:
    """The tuning table per op (latency per variant, the best, speedup vs BSP) and the strong-scaling table."""
    if plot:
        check_new([plot], force)
    found = load(db, mode, fingerprint, op)
    sections = []
    for m, rows, fp in found:
        table = problem_table(rows, interpreted(fp.get("device_kind")))
        scaling = scaling_table(table)
        sections.append((m, table, scaling, fp.get("id")))
        if not json_out:
            print_problems(out, table, m, f", environment {fp.get('id')}")
            if scaling:
                _print_scaling(scaling, m)
    if json_out:
        print(json.dumps({m: {"fingerprint": fp_id, "problems": table, "scaling": scaling}
                          for m, table, scaling, fp_id in sections}, indent=1, sort_keys=True))
    if plot:
        draw([(m, table, scaling) for m, table, scaling, _ in sections], plot, x, force)


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(table: list[dict], xd: str) -> dict[tuple, list[tuple[float, dict]]]:
    """Problems grouped into series along `xd` ('size' = the product of the numeric dims)."""
    from autofuse.core.op import Problem

    series: dict[tuple, list[tuple[float, dict]]] = {}
    for e in table:
        p = Problem.from_key(e["problem"])
        dims = dict(p.dims)
        if xd == "size":
            xv = math.prod(v for v in dims.values() if _numeric(v))
            rest = tuple((k, v) for k, v in p.dims if not _numeric(v))
        elif xd in dims and _numeric(dims[xd]):
            xv, rest = dims[xd], tuple((k, v) for k, v in p.dims if k != xd)
        else:
            continue
        key = (p.op, p.dtype, p.world, tuple((k, (0, v, "") if _numeric(v) else (1, 0, str(v))) for k, v in rest))
        series.setdefault(key, []).append((float(xv), e))
    return series


def _pick_x(table: list[dict], x: str | None) -> tuple[str, dict]:
    """The x dimension for one op's problems: --x, else M or B, else whichever gives the longest series."""
    if x:
        return x, _series(table, x)
    from autofuse.core.op import Problem

    names: list[str] = []
    for e in table:
        names += [k for k, v in Problem.from_key(e["problem"]).dims if _numeric(v) and k not in names]
    preferred = [d for d in ("M", "B") if d in names] + [d for d in names if d not in ("M", "B")] + ["size"]
    tried = [(d, _series(table, d)) for d in preferred]
    for d, s in tried:  # the first that gives some series two or more points
        if max((len(v) for v in s.values()), default=0) >= 2:
            return d, s
    return tried[0]


def draw(sections: list[tuple[str, list[dict], list[dict]]], path: Path, x: str | None, force: bool = False) -> None:
    """Per op, mode and series: latency and speedup vs x per variant; then the strong scaling per op and mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib, which is not installed: pip install 'autofuse[plot]' (or matplotlib)")
    panels: list[tuple[str, str, str, list]] = []  # (mode, label, x name, points)
    single = True
    for mode, table, _ in sections:
        for name in sorted({e["op"] for e in table}):
            xd, series = _pick_x([e for e in table if e["op"] == name], x)
            for key in sorted(series):
                pts = sorted(series[key], key=lambda p: p[0])
                single &= len(pts) == 1
                rest = ",".join(f"{k}={v[1] if v[0] == 0 else v[2]}" for k, v in key[3])
                panels.append((mode, f"{key[0]} {rest} {key[1]} w{key[2]} ({mode} mode)", xd, pts))
    scaling = [(mode, name, [s for s in sc if s["op"] == name]) for mode, _, sc in sections
               for name in sorted({s["op"] for s in sc})]
    if not panels and not scaling:
        fail("nothing to plot: no problem has the x dimension")
    shown = panels[:12]
    rows = len(shown) + len(scaling[:4])
    fig = plt.figure(figsize=(12, 3.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, 2)

    def row_axes(row: int, speedups: bool) -> tuple[Any, Any]:
        """A row's latency axes and its speedup axes beside; without speedups (interpreter timings) the
        latency takes the whole row."""
        if not speedups:
            return fig.add_subplot(grid[row, :]), None
        return fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])

    for row, (mode, label, xd, pts) in enumerate(shown):
        xs = [p[0] for p in pts]
        variants = ["bsp"] + sorted({v for _, e in pts for v in e["us"]} - {"bsp"})
        interp = any(e["interpreted"] for _, e in pts)
        ax_t, ax_s = row_axes(row, not interp)
        for v in variants:
            ys = [e["us"].get(v, math.nan) for _, e in pts]
            style = {"color": "black", "linewidth": 2} if v == "bsp" else {}
            ax_t.plot(xs, ys, marker="o", markersize=7 if single else 4, label=v, **style)
            if ax_s is not None:
                sp = [(e["bsp_us"] or math.nan) / e["us"].get(v, math.nan) for _, e in pts]
                ax_s.plot(xs, sp, marker="o", markersize=7 if single else 4, label=v, **style)
        bounds = [e.get("bound_us") or math.nan for _, e in pts]
        if any(b == b for b in bounds):
            ax_t.plot(xs, bounds, linestyle="--", color="gray", label="bound")
        for ax in (ax_t, ax_s):
            if ax is None:
                continue
            ax.set_xscale("log", base=2)
            ax.set_xlabel("problem size (product of its numeric dims)" if xd == "size" else xd)
            ax.grid(True, alpha=0.3)
        (ax_s or ax_t).legend(fontsize=7)
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"us per call ({mode})")
        note_cpu = " (CPU emulation: interpreter timings, no speedup)" if interp else ""
        ax_t.set_title(textwrap.fill(label + note_cpu, 120 if interp else 60), fontsize=9)
        if ax_s is not None:
            ax_s.set_ylabel("speedup vs bsp")
            ax_s.set_title("speedup vs bsp", fontsize=9)
    for row, (mode, name, entries) in enumerate(scaling[:4], start=len(shown)):
        key_cols, cells, _ = split_problems([s["sizes"] + "|" for s in entries])
        speedups = any(s["per_world"][str(w)]["speedup_vs_smallest"] is not None for s in entries for w in s["worlds"])
        ax_t, ax_s = row_axes(row, speedups)
        worlds = sorted({w for s in entries for w in s["worlds"]})
        for s in entries[:8]:
            ws = s["worlds"]
            label = " ".join(f"{k}={v}" for k, v in zip(key_cols, cells[s["sizes"] + "|"]))
            line = ax_t.plot(ws, [s["per_world"][str(w)]["us"] for w in ws], marker="o", label=label)[0]
            for w in ws:
                ax_t.annotate(s["per_world"][str(w)]["variant"], (w, s["per_world"][str(w)]["us"]), fontsize=6,
                              xytext=(3, 3), textcoords="offset points", color=line.get_color())
            if ax_s is not None:
                ax_s.plot(ws, [s["per_world"][str(w)]["speedup_vs_smallest"] or math.nan for w in ws], marker="o",
                          label=label)
        if ax_s is not None:
            ax_s.plot(worlds, [w / worlds[0] for w in worlds], linestyle="--", color="gray", label="ideal")
        for ax in (ax_t, ax_s):
            if ax is None:
                continue
            ax.set_xscale("log", base=2)
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_xlabel("world size (GPUs)")
            ax.grid(True, alpha=0.3)
        (ax_s or ax_t).legend(fontsize=7)
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"best us per call ({mode})")
        note_cpu = "; CPU emulation: interpreter timings, no speedup" if not speedups else ""
        ax_t.set_title(f"{name}: strong scaling, best variant per world size ({mode} mode{note_cpu})", fontsize=9)
        if ax_s is not None:
            ax_s.set_ylabel(f"speedup over w{worlds[0]}")
            ax_s.set_title(f"{name}: speedup over the smallest world size", fontsize=9)
    heading = []
    if len(panels) > len(shown):
        heading.append(f"first {len(shown)} of {len(panels)} series (filter with --op or --mode)")
    if single and shown:
        heading.append("one point per series: each problem differs from the others in more than the x dimension")
    if heading:
        fig.suptitle("; ".join(heading), fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    try:
        write_new(path, buf.getvalue(), force)
    except OutputExists as exc:
        fail(str(exc))
    if single and shown:
        note("plot: one point per series (each problem differs from the others in more than the x dimension)")
    out.print(f"plot written to {path}")


def register(app: typer.Typer) -> None:
    app.command("fit")(fit)
    app.command("export")(export)
    app.command("show")(show)
