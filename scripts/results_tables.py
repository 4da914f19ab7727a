#!/usr/bin/env python3
"""Markdown tables from `autofuse bench` JSON: `python3 scripts/results_tables.py JSON... > out.md`.

Per file and timing mode (graph first, then eager), one row per problem, labelled by the problem
dimensions that vary within the file (the constant ones go in the heading). Columns: every
variant's best time (us per call, rank-max median over the variant's known-good configs), the
pieces of the bound and the bound (= max of the pieces), the best fused variant, its speedup over
BSP (BSP us / fused us), over torch_symm where the op has it, the fused time over the bound, and the
p10-p90 spread of the BSP and the best-fused measurement (% of their medians, from the raw rows:
a noise gauge). A geomean line follows each table; ops that report `bandwidth` (flash_decode) get a
bandwidth table.

`--db DB --op OP [--against LABEL=BENCH_JSON ...]` renders an `autofuse tune` database instead: per
timing mode, one row per tuned problem with BSP, torch_symm, the best fused variant over every config
the tuner measured (its config, its speedup over BSP), the fastest candidate of all, and optionally
each bench file's best fused for the same problem and mode (the hand-picked configs) over the tuned
one. `--fit FIT_JSON` renders an `autofuse fit --report` (per op: each model's held-out metrics, the
kept one, always-BSP and the oracle); `--eval EVAL_JSON` renders `scripts/eval_dispatch_gpu.py` output
(the summary per op, then every call: pick, kind, its time, BSP, the fastest measured candidate).
`--db DB --op OP --scaling` renders the strong scaling instead: per timing mode, one row per problem
size (global: an op's per-rank dims times the world size) measured at two or more world sizes, with the fastest
candidate and its time per world size and the speedup over the smallest world size. A bench JSON of
an extra target (`autofuse bench collectives|gemm_core|layer`: no `op`) renders as one plain table of
its rows. Deterministic, stdlib only.
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import quote

RESULT_KEYS = {"problem", "op", "dtype", "world", "mode", "best_us", "config", "pieces_us", "bound_us", "best_fused",
               "best_fused_us", "speedup_vs_bsp", "vs_bound", "failures", "bandwidth"}
MODE_ORDER = ("graph", "eager")
BASELINES = ("bsp", "torch_symm")  # not fused: "best fused" is the fastest of the other variants
SHORT_KEYS = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "GROUP_M": "G", "num_warps": "w",
              "num_stages": "s", "COMM_SMS": "sms"}


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def geomean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if finite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def fmt(x: Any, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if finite(x) else "-"


def dims(row: dict) -> dict[str, Any]:
    """The problem's own dimensions (M, N, K, B, S, ...), in the JSON's order."""
    return {k: v for k, v in row.items() if k not in RESULT_KEYS}


def varying(rows: Sequence[dict]) -> tuple[list[str], dict[str, Any]]:
    """(names of the dimensions that vary across rows, the constant ones with their value)."""
    names = list(dims(rows[0])) if rows else []
    vary = [k for k in names if len({json.dumps(r.get(k)) for r in rows}) > 1]
    return vary, {k: rows[0][k] for k in names if k not in vary}


def spreads(doc: dict) -> dict[tuple[str, str, str, str], float]:
    """(problem, mode, variant, config json) -> (p90 - p10) / median of that measurement."""
    out = {}
    for m in doc.get("raw", []):
        if m.get("ok") and finite(m.get("median_us")) and m["median_us"] > 0:
            key = (m["problem"], m["mode"], m["variant"], json.dumps(m["config"], sort_keys=True))
            out[key] = (m["p90_us"] - m["p10_us"]) / m["median_us"]
    return out


def spread_of(sp: dict, row: dict, variant: str) -> float:
    if variant not in row["best_us"]:
        return math.nan
    key = (row["problem"], row["mode"], variant, json.dumps(row["config"].get(variant, {}), sort_keys=True))
    return sp.get(key, math.nan)


def table(header: Sequence[str], body: Sequence[Sequence[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"] + \
           ["| " + " | ".join(cells) + " |" for cells in body]


def machine(doc: dict) -> str:
    fp = doc.get("fingerprint", {})
    return (f"{fp.get('gpu_count', '?')}x {fp.get('gpu_name', '?')} (topology {fp.get('topology', '?')}), "
            f"driver {fp.get('driver', '?')}, CUDA {fp.get('cuda', '?')}, torch {fp.get('torch', '?')}, "
            f"Triton {fp.get('triton', '?')}, NCCL {fp.get('nccl', '?')}"
            + (f", kernel hash {fp['kernel_hash']}" if fp.get("kernel_hash") else ""))


def mode_table(doc: dict, rows: list[dict], vary: list[str], sp: dict) -> list[str]:
    variants = doc["variants"]
    pieces = list(dict.fromkeys(p for r in rows for p in r["pieces_us"]))
    symm = "torch_symm" in variants
    header = [*vary, *(f"{v} us" for v in variants), *(f"{p} us" for p in pieces), "bound us", "best fused",
              "x BSP", *(["x torch_symm"] if symm else []), "fused / bound", "spread % bsp / fused"]
    body = []
    for r in rows:
        cells = [str(r[k]) for k in vary]
        cells += [fmt(r["best_us"][v]) if v in r["best_us"] else ("fail" if v in r["failures"] else "-")
                  for v in variants]
        cells += [fmt(r["pieces_us"].get(p)) for p in pieces]
        fused, fused_us = r["best_fused"], r["best_fused_us"]
        cells += [fmt(r["bound_us"]), fused, fmt(r["speedup_vs_bsp"], 2)]
        if symm:
            cells.append(fmt(r["best_us"].get("torch_symm", math.nan) / fused_us if finite(fused_us) else math.nan, 2))
        cells.append(fmt(r["vs_bound"], 2))
        cells.append(f"{fmt(100 * spread_of(sp, r, 'bsp'), 0)} / {fmt(100 * spread_of(sp, r, fused), 0)}")
        body.append(cells)
    lines = table(header, body, right_from=len(vary))
    symm_gm = ""
    if symm:
        symm_gm = ", over torch_symm " + fmt(geomean(r["best_us"].get("torch_symm", math.nan) / r["best_fused_us"]
                                                     for r in rows if finite(r["best_fused_us"])), 3) + "x"
    lines += ["", f"Geomean over {len(rows)} problems: best fused over BSP {fmt(geomean(r['speedup_vs_bsp'] for r in rows), 3)}x"
              f"{symm_gm}, best fused / bound {fmt(geomean(r['vs_bound'] for r in rows), 3)}."]
    fails = [(r, v, why) for r in rows for v, why in r["failures"].items()]
    for r, v, why in fails:
        lines.append(f"- failed: {v} on {' '.join(f'{k}={r[k]}' for k in vary)}: {why}")
    return lines


def bandwidth_table(rows: list[dict], vary: list[str], best_copy: dict[str, float]) -> list[str]:
    header = [*vary, "KV MB", "local us", "local GB/s (read)", "copy us", "copy GB/s (read+write)", "local / copy",
              "local / best copy"]
    body = []
    for r in rows:
        bw = r["bandwidth"]
        best = best_copy.get(r["problem"], math.nan)
        body.append([*(str(r[k]) for k in vary), fmt(bw["bytes"] / 1e6, 1), fmt(r["pieces_us"].get("local")),
                     fmt(bw.get("local_GBps"), 0), fmt(bw.get("copy_us")), fmt(bw.get("copy_GBps"), 0),
                     fmt(bw.get("local_vs_copy"), 2), fmt(bw.get("local_GBps", math.nan) / best, 2)])
    return table(header, body, right_from=len(vary))


def render(doc: dict, source: str, level: int = 3) -> str:
    """Markdown for one bench JSON document."""
    h = "#" * level
    rows = doc["rows"]
    vary, const = varying(rows)
    fixed = ", ".join(f"{k}={v}" for k, v in const.items() if k not in ("op",))
    out = [f"{h} {doc['op']}, sweep `{doc['sweep']}`", "",
           f"Source `{source}`; run {doc.get('date', '?')}; {machine(doc)}. Fixed: {fixed}. "
           "Times in us per call (median of timed batches, max over ranks); each variant at the best of its "
           "known-good configs.", ""]
    sp = spreads(doc)
    modes = sorted(doc["modes"], key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m))
    best_copy: dict[str, float] = {}
    for r in rows:
        if r.get("bandwidth", {}).get("copy_GBps"):
            best_copy[r["problem"]] = max(best_copy.get(r["problem"], 0.0), r["bandwidth"]["copy_GBps"])
    for mode in modes:
        mrows = [r for r in rows if r["mode"] == mode]
        out += [f"{h}# {mode} mode", "", *mode_table(doc, mrows, vary, sp), ""]
        bw = [r for r in mrows if r.get("bandwidth", {}).get("local_GBps")]
        if bw:
            out += [f"Local kernel (split-KV + merge of splits, the bound's `local` piece) vs a device copy of the same "
                    f"bytes, {mode} mode. The local kernel reads the KV bytes once; the copy reads and writes them, so "
                    "its rate counts 2 x bytes / time. `best copy` is the higher of the two modes' copy rates for the "
                    "problem.", "", *bandwidth_table(bw, vary, best_copy), ""]
    return "\n".join(out)


def short_config(config: dict) -> str:
    """A config in one short cell: BLOCK sizes as BMxBNxBK, the rest as key=value (known keys abbreviated)."""
    c = dict(config)
    parts = []
    if all(k in c for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")):
        parts.append(f"{c.pop('BLOCK_M')}x{c.pop('BLOCK_N')}x{c.pop('BLOCK_K')}")
    parts += [f"{SHORT_KEYS.get(k, k)}={v}" for k, v in sorted(c.items())]
    return " ".join(parts) or "-"


def read_db(path: Path, op: str) -> tuple[list[dict], dict]:
    """The op's successful measurements (with the problem's dims) and the environment rows, read-only."""
    uri = f"file:{quote(str(path.absolute()))}?mode=ro"
    with open(path, "rb") as f:
        header = f.read(20)
    if len(header) == 20 and header[18] == 2 and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"  # WAL mode, nobody writing: read without leaving -wal/-shm files behind
    con = sqlite3.connect(uri, uri=True)
    con.row_factory = sqlite3.Row
    try:
        dims = {r["key"]: {**json.loads(r["dims"]), "world": r["world"]}
                for r in con.execute("SELECT key, dims, world FROM problems WHERE op = ?", (op,))}
        rows = [dict(r) for r in con.execute("SELECT problem, variant, config, mode, median_us, source, created_at "
                                             "FROM measurements WHERE op = ? AND ok = 1 ORDER BY id", (op,))]
        envs = {r["id"]: dict(r) for r in con.execute("SELECT * FROM environments")}
    finally:
        con.close()
    for r in rows:
        r["dims"], r["config"] = dims.get(r["problem"], {}), json.loads(r["config"] or "{}")
    return rows, envs


def best_per_problem(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(problem, mode) -> {"dims", "trials", "best": {variant: (us, config)}} over every measured config."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        if not finite(r["median_us"]):
            continue
        e = out.setdefault((r["problem"], r["mode"]), {"dims": r["dims"], "trials": 0, "best": {}})
        e["trials"] += r["source"] == "tune"
        old = e["best"].get(r["variant"])
        if old is None or r["median_us"] < old[0]:
            e["best"][r["variant"]] = (r["median_us"], r["config"])
    return out


def tuned_table(entries: list[dict], vary: list[str], against: Sequence[tuple[str, dict]], symm: bool) -> list[str]:
    header = [*vary, "trials", "bsp us", *(["torch_symm us"] if symm else []), "best fused", "fused us", "x BSP",
              "fused config", "fastest"]
    for label, _ in against:
        header += [f"{label} fused us", f"{label} / tuned"]
    body, speedups, fastest_gain, fused_us = [], [], [], []
    for e in entries:
        best = e["best"]
        bsp = best.get("bsp", (math.nan, {}))[0]
        fused = {v: t for v, t in best.items() if v not in BASELINES}
        fv = min(sorted(fused), key=lambda v: fused[v][0]) if fused else None
        fus = fused[fv][0] if fv else math.nan
        fused_us.append(fus)
        fastest = min(sorted(best), key=lambda v: (best[v][0], v != "bsp"))
        speedups.append(bsp / fus if finite(fus) else math.nan)
        fastest_gain.append(bsp / best[fastest][0])
        cells = [str(e["dims"].get(k)) for k in vary] + [str(e["trials"]), fmt(bsp)]
        if symm:
            cells.append(fmt(best.get("torch_symm", (math.nan,))[0]))
        cells += [fv or "-", fmt(fus), fmt(speedups[-1], 2), short_config(fused[fv][1]) if fv else "-", fastest]
        for _, ref in against:
            hand = ref.get(e["key"], math.nan)
            cells += [fmt(hand), fmt(hand / fus if finite(fus) else math.nan, 2)]
        body.append(cells)
    lines = table(header, body, right_from=len(vary))
    lines += ["", f"Geomean over {len(entries)} problems: best fused over BSP {fmt(geomean(speedups), 3)}x; fastest "
              f"candidate (BSP and torch_symm included) over BSP {fmt(geomean(fastest_gain), 3)}x."]
    for label, ref in against:
        ratios = [ref.get(e["key"], math.nan) / fus for e, fus in zip(entries, fused_us) if finite(fus)]
        lines.append(f"Geomean {label} best fused / tuned best fused: {fmt(geomean(ratios), 3)} "
                     "(> 1: the tuned configs are faster).")
    return lines


def bench_best_fused(doc: dict) -> dict[str, dict[str, float]]:
    """mode -> problem -> the bench's best fused us."""
    out: dict[str, dict[str, float]] = {}
    for r in doc["rows"]:
        us = r.get("best_fused_us", r.get("best_variant_us"))  # round 1's bench JSON, or today's
        out.setdefault(r["mode"], {})[r["problem"]] = us if finite(us) else math.nan
    return out


def render_tuned(db: Path, op: str, against: Sequence[tuple[str, dict]] = (), level: int = 3) -> str:
    """Markdown for one op of an `autofuse tune` database: one table per timing mode."""
    h = "#" * level
    rows, envs = read_db(db, op)
    if not rows:
        return f"{h} {op}, tuned\n\nNo measurements of {op} in `{db.as_posix()}`.\n"
    best = best_per_problem(rows)
    probs = list(dict.fromkeys(r["problem"] for r in rows))
    dims_of = {r["problem"]: r["dims"] for r in rows}
    vary, const = varying([{**dims_of[p], "op": op} for p in probs])
    worlds = sorted({dims_of[p].get("world") for p in probs}, key=str)
    if len(worlds) > 1:  # several world sizes (`tune --world 1,2`): a column; else it goes in the heading
        vary.append("world")
    else:
        const["world"] = worlds[0]
    fixed = ", ".join(f"{k}={v}" for k, v in const.items() if k != "op")
    env = "; ".join(f"{e.get('gpu_count')}x {e.get('gpu_name')} (topology {e.get('topology')}), driver "
                    f"{e.get('driver')}, CUDA {e.get('cuda')}, torch {e.get('torch')}, Triton {e.get('triton')}, "
                    f"NCCL {e.get('nccl')}" + (f", kernel hash {e['kernel_hash']}" if e.get("kernel_hash") else "")
                    + f", fingerprint {k}"
                    for k, e in sorted(envs.items()))
    times = sorted(r["created_at"] for r in rows)
    symm = any(r["variant"] == "torch_symm" for r in rows)
    out = [f"{h} {op}, tuned (`autofuse tune`)", "",
           f"Source `{db.as_posix()}` ({len(rows)} measurements of {op}, written {times[0]} to {times[-1]}); {env}. "
           f"Fixed: {fixed}. Times in us per call (median of timed batches, max over ranks); each variant at the "
           "best of the configs the tuner measured; `trials` counts tuner trials (baselines excluded).", ""]
    modes = sorted({r["mode"] for r in rows},
                   key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m))
    for mode in modes:
        entries = [dict(best[(p, mode)], key=p) for p in probs if (p, mode) in best]
        refs = [(label, bench_best_fused(doc).get(mode, {})) for label, doc in against]
        out += [f"{h}# {mode} mode", "", *tuned_table(entries, vary, refs, symm), ""]
    return "\n".join(out)


def fit_table(doc: dict) -> list[str]:
    """One row per (op, model): held-out quality (k folds by problem) of each model, always-BSP, the oracle."""
    header = ["op", "problems", "model", "within 5%", "latency / oracle", "x BSP", "worst / BSP",
              "correct / wrong / unsure", "unsure margin"]
    body = []
    for op, o in sorted(doc["ops"].items()):
        entries = [(f"{name} (kept)" if name == o.get("kept") else name, r) for name, r in sorted(o["models"].items())]
        entries += [("always bsp" if name == "bsp" else name, r) for name, r in sorted(o.get("baselines", {}).items())]
        for name, r in entries:
            margin = r.get("margin")
            body.append([op, str(o["problems"]), name, f"{100 * r['within_5pct']:.0f}%", fmt(r["geomean_vs_oracle"], 3),
                         fmt(r["speedup_vs_bsp"], 3), fmt(r["worst_vs_bsp"], 3),
                         f"{r['correct']} / {r['wrong']} / {r['unsure']}",
                         f"{math.exp(margin):.3f}x (q{r['margin_quantile']:.2f})" if finite(margin) else "-"])
    return table(header, body, right_from=3)


def eval_tables(doc: dict) -> list[str]:
    """The summary per op, then one row per call of a held-out dispatch evaluation."""
    header = ["op", "calls", "within 5%", "pick / oracle", "pick / BSP", "worst pick / BSP", "kinds"]
    body = [[k, str(v["calls"]), f"{100 * v['within_5pct']:.0f}%", fmt(v["geomean_vs_oracle"], 3),
             fmt(v["geomean_vs_bsp"], 3), fmt(v["worst_vs_bsp"], 3),
             ", ".join(f"{n} {c}" for n, c in sorted(v["kinds"].items()))] for k, v in doc["summary"].items()]
    lines = table(header, body, right_from=1) + [""]
    header = ["op", "problem", "pick", "kind", "pick us", "bsp us", "fastest", "fastest us", "pick / fastest",
              "pick / BSP", "within 5%"]
    body = []
    for r in doc["rows"]:
        cands = dict(r["us"], **{r["pick"]: min(r["pick_us"], r["us"].get(r["pick"], math.inf))})
        fastest = min(sorted(cands), key=lambda v: cands[v])
        oracle = cands[fastest]
        bsp = r["us"].get("bsp", math.nan)
        body.append([r["op"], r["problem"].split("|")[1], r["pick"], r["kind"], fmt(r["pick_us"]), fmt(bsp), fastest,
                     fmt(oracle), fmt(r["pick_us"] / oracle, 3), fmt(r["pick_us"] / bsp, 3),
                     "yes" if r["pick_us"] <= 1.05 * oracle else "**no**"])
    return lines + table(header, body, right_from=4)


def render_scaling(db: Path, op: str, level: int = 3) -> str:
    """Markdown strong-scaling tables for one op of a tune database: per mode, per problem size, the
    fastest candidate and its time at each world size, and the speedup over the smallest world size."""
    from autofuse.commands.results import scaling_sizes
    from autofuse.core.op import Problem

    h = "#" * level
    rows, _ = read_db(db, op)
    best = best_per_problem(rows)
    groups: dict[tuple[str, str], dict[int, tuple[str, float]]] = {}
    sizes_dims: dict[str, dict] = {}
    for (problem, mode), e in best.items():
        sizes, world = scaling_sizes(problem)
        variant = min(sorted(e["best"]), key=lambda v: (e["best"][v][0], v != "bsp"))
        groups.setdefault((sizes, mode), {})[world] = (variant, e["best"][variant][0])
        sizes_dims[sizes] = dict(Problem.from_key(f"{sizes}|w1").dims)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    out = [f"{h} {op}, strong scaling (`autofuse tune --world ...`)", ""]
    if not groups:
        return "\n".join(out + [f"No {op} problem of `{db.as_posix()}` was measured at two or more world sizes.", ""])
    out += [f"Source `{db.as_posix()}`. Per global problem size (per-rank dims, e.g. ag_gemm's N, times the world size): the fastest "
            "candidate over every config measured (BSP included), its time in us per call (median, max over "
            "ranks), and the speedup = time at the smallest world size / time at this one.", ""]
    modes = sorted({m for _, m in groups}, key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else 9, m))
    for mode in modes:
        keys = [k for k in groups if k[1] == mode]
        worlds = sorted({w for k in keys for w in groups[k]})
        keys.sort(key=lambda k: [(n, v if isinstance(v, int) else 0, str(v))
                                 for n, v in sorted(sizes_dims[k[0]].items())])
        vary, const = varying([sizes_dims[k[0]] for k in keys])
        header = [*vary]
        for w in worlds:
            header += [f"w{w} fastest", f"w{w} us"] + ([f"w{w} speedup"] if w != worlds[0] else [])
        body = []
        for k in keys:
            per = groups[k]
            base = per.get(worlds[0], (None, math.nan))[1]
            cells = [str(sizes_dims[k[0]].get(n)) for n in vary]
            for w in worlds:
                v, t = per.get(w, ("-", math.nan))
                cells += [v, fmt(t)] + ([fmt(base / t if finite(t) else math.nan, 2)] if w != worlds[0] else [])
            body.append(cells)
        fixed = ", ".join(f"{n}={v}" for n, v in const.items())
        title = f"{h}# {mode} mode" + (f" ({fixed})" if fixed else "")
        out += [title, "", *table(header, body, right_from=len(vary)), ""]
    return "\n".join(out)


def render_generic(doc: dict, source: str, level: int = 3) -> str:
    """Markdown for a bench JSON of an extra target (no `op`): its rows as one table, scalar cells only."""
    h = "#" * level
    rows = doc.get("rows", [])
    cols = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
    cell = lambda v: fmt(v, 2) if isinstance(v, float) else "-" if v is None else str(v)  # noqa: E731
    body = [[cell(r.get(c)) for c in cols] for r in rows]
    return "\n".join([f"{h} {doc.get('target', '?')}, sweep `{doc.get('sweep', '-')}`", "",
                      f"Source `{source}`; run {doc.get('date', '?')}; {machine(doc)}.", "",
                      *table(cols, body, right_from=len(cols)), ""])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", type=Path, help="bench JSON files written by `autofuse bench`")
    ap.add_argument("--level", type=int, default=3, help="Markdown heading level of each file's section")
    ap.add_argument("--db", type=Path, help="an `autofuse tune` database (sqlite) to render instead")
    ap.add_argument("--op", action="append", default=[], help="op(s) of --db to render")
    ap.add_argument("--against", action="append", default=[], metavar="LABEL=JSON",
                    help="a bench JSON whose best fused (hand-picked configs) is compared with the tuned one")
    ap.add_argument("--fit", type=Path, help="an `autofuse fit --report` JSON to render instead")
    ap.add_argument("--eval", type=Path, help="a scripts/eval_dispatch_gpu.py JSON to render instead")
    ap.add_argument("--scaling", action="store_true", help="with --db: the strong-scaling tables instead")
    args = ap.parse_args(argv)
    if args.fit is not None:
        parts = fit_table(json.loads(args.fit.read_text())) + [""]
    elif args.eval is not None:
        parts = eval_tables(json.loads(args.eval.read_text())) + [""]
    elif args.db is not None:
        if not args.op:
            ap.error("--db needs --op")
        against = []
        for spec in args.against:
            label, sep, path = spec.partition("=")
            if not sep:
                ap.error(f"--against wants LABEL=JSON, got {spec!r}")
            against.append((label, json.loads(Path(path).read_text())))
        if args.scaling:
            parts = [render_scaling(args.db, op, args.level) for op in args.op]
        else:
            parts = [render_tuned(args.db, op, against, args.level) for op in args.op]
    elif args.json:
        docs = [(json.loads(p.read_text()), p.as_posix()) for p in args.json]
        parts = [render(d, src, args.level) if "op" in d else render_generic(d, src, args.level) for d, src in docs]
    else:
        ap.error("give bench JSON files, --db, --fit or --eval")
    sys.stdout.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
