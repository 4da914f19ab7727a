"""The results tables of every command: problem keys as cells, tables readable at 80 columns (split, never
truncated), and the per-problem table of `show`, `export`, `tune` and `bench` (the numbers of
autofuse.measure.compare).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from autofuse.core.keys import parse_key


def _sort_value(v: Any) -> tuple:
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


def problem_sort_key(key: str) -> tuple:
    """Problems in numeric order of their sizes (1024 before 16384), then dtype and world size."""
    try:
        p = parse_key(key)
    except ValueError:
        return (key, "", (), _sort_value(""))
    parts = tuple((k, _sort_value(v)) for k, v in p.dims.items())
    return (p.op, p.dtype, parts, _sort_value(p.world if p.world is not None else ""))


def split_problems(keys: Sequence[str]) -> tuple[list[str], dict[str, list[str]], str]:
    """Problem keys as table cells: (columns of the parts that vary, each key's cells, the fixed parts).

    Parts are the op's dims, `dtype` and `world`; a part the keys share goes into the fixed text
    (for the title), so tables show only what changes from row to row.
    """
    parsed: dict[str, dict[str, str]] = {}
    names: list[str] = []
    for key in keys:
        p = parse_key(key)
        d = {"op": p.op, **{k: str(v) for k, v in p.dims.items()}, "dtype": p.dtype}
        if p.world is not None:  # keys without the world part (strong-scaling groups) have no world column
            d["world"] = str(p.world)
        parsed[key] = d
        names += [n for n in d if n not in names]
    vary = [n for n in names if len({parsed[k].get(n) for k in keys}) > 1]
    if not vary and keys:
        vary = [next((n for n in names if n not in ("op", "dtype", "world")), "world")]
    fixed = [f"{n}={parsed[keys[0]].get(n)}" if n not in ("op", "dtype") else str(parsed[keys[0]].get(n))
             for n in names if n not in vary and n != "op"] if keys else []
    fixed = [("w" + f[6:] if f.startswith("world=") else f) for f in fixed]
    cells = {k: [parsed[k].get(n, "-") for n in vary] for k in keys}
    return vary, cells, " ".join(fixed)


def _width(text: str, wraps: bool) -> int:
    return max((len(w) for w in text.split()), default=0) if wraps else len(text)


def print_split_table(console: Console, title: str, key_cols: Sequence[str], value_cols: Sequence[str],
                      body: Sequence[Sequence[str]], width: int | None = None) -> None:
    """A table whose value columns are split over several tables when they do not fit the console width.

    Key columns repeat in every part; headers may wrap at spaces, cells never truncate (long
    words fold), so nothing is cut to '...' at 80 columns or in a pipe.
    """
    width = width or console.width
    nkey = len(key_cols)
    heads = [*key_cols, *value_cols]

    def col_width(i: int, wrap: bool) -> int:
        return max([_width(heads[i], wrap)] + [len(str(row[i])) for row in body]) + 3

    key_w = sum(col_width(i, True) for i in range(nkey)) + 1
    chunks: list[list[int]] = [[]]
    used = key_w
    for j in range(len(value_cols)):
        w = col_width(nkey + j, True)
        if chunks[-1] and used + w > width:
            chunks.append([])
            used = key_w
        chunks[-1].append(j)
        used += w
    cap = max(8, width - 4)
    for n, chunk in enumerate(chunks):
        part = f" (part {n + 1} of {len(chunks)})" if len(chunks) > 1 else ""
        console.print(title + part, style="bold", soft_wrap=False)
        t = Table()
        # fixed widths: each column as wide as its widest cell (cells never wrap); headers unwrapped where
        # the part fits so, else wrapped at spaces; only a cell wider than the console folds
        columns = [*range(nkey), *(nkey + j for j in chunk)]
        wrap = sum(col_width(i, False) for i in columns) + 1 > width
        for i in columns:
            t.add_column(heads[i], justify="right" if i >= nkey else "left", overflow="fold",
                         width=min(cap, col_width(i, wrap) - 3))
        for row in body:
            t.add_row(*[str(c) for c in row[:nkey]], *[str(row[nkey + j]) for j in chunk])
        console.print(t)


# ---------------------------------------------------------------------------------------------
# the problem table of show, export and tune: one row per problem, the numbers of autofuse.measure.compare


def problem_table(rows: list[dict], interpreted: bool = False) -> list[dict]:
    """Per problem: latency and config per variant, and the numbers of `autofuse.measure.compare` (best, x BSP,
    x alt, bound, ceiling; no ratio where `interpreted`, nor for an `unconfirmed` outlier:
    `compare.withhold`). Rows of variant `bound` (or its pieces `bound.*`, whose max is the bound)
    are shown, never chosen. `timed_eager[v]`: v's row was timed eagerly in graph mode (not capturable:
    autofuse.measure.timing.timed_mode)."""
    from autofuse.measure.compare import compare, withhold

    by: dict[str, dict] = {}
    for r in rows:
        e = by.setdefault(r["problem"], {"op": r["op"], "problem": r["problem"], "us": {}, "configs": {},
                                         "confirmed": {}, "timed_eager": {}, "bound_pieces": {},
                                         "stale": False})
        v, t = r["variant"], r["median_us"]
        e["stale"] |= bool(r.get("stale"))
        if v == "bound":
            e["bound_us"] = t
        elif v.startswith("bound"):
            e["bound_pieces"][v] = t
        elif v not in e["us"] or t < e["us"][v]:
            e["us"][v], e["configs"][v] = t, r["config"]
            e["confirmed"][v] = bool((r.get("extra") or {}).get("confirmed"))
            e["timed_eager"][v] = bool((r.get("extra") or {}).get("timed_eager"))
    out_rows = []
    for key in sorted(by, key=problem_sort_key):
        e = by[key]
        if "bound_us" not in e and e["bound_pieces"]:
            e["bound_us"] = max(e["bound_pieces"].values())
        e.update(compare(e["op"], e["us"], e.get("bound_us"), interpreted).as_dict())
        out_rows.append(e)
    return withhold(out_rows)


def fmt(x: Any, digits: int = 1) -> str:
    """A number for a table cell; '-' for None or non-finite."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


LEGEND = ("best: the fastest variant, BSP included; x BSP: BSP us / best us; x alt: the fastest alternative "
          "users run instead (torch's symmetric-memory ops) us / best us; own: autofuse's own fastest variant "
          "(hybrid, fused); own/alt: the fastest alternative us / own us (below 1.00: torch's op beats every kernel "
          "of autofuse's own); bound: the slowest piece timed alone (perfect overlap); ceiling: BSP us / bound us")
STALE_NOTE = ("stale: measured with older code of the op; dispatch uses such entries as predictions and "
              "confirms each on first use (`stale: confirmed` in autofuse.explain)")


def print_problems(console: Console, table: list[dict], mode: str, where: str = "") -> None:
    """Per op: latency per variant (BSP first), best, x BSP, x alt, own and own/alt (where an alternative was
    measured),
    bound and ceiling (where timed); interpreter timings get latencies and best only; a `stale` column
    where some problem's rows were measured with older code of the op; a `*` on a latency timed eagerly in
    graph mode (the variant cannot be captured), with a footnote."""
    from autofuse.measure.compare import INTERPRETED_NOTE, TIMED_EAGER_NOTE, UNCONFIRMED_ALT_NOTE, UNCONFIRMED_NOTE

    interpreted = False
    for name in sorted({e["op"] for e in table}):
        entries = [e for e in table if e["op"] == name]
        variants = ["bsp"] + sorted({v for e in entries for v in e["us"]} - {"bsp"})
        key_cols, cells, fixed = split_problems([e["problem"] for e in entries])
        interp = any(e["interpreted"] for e in entries)
        interpreted |= interp
        cols: list[tuple[str, Any]] = [("best", lambda e: e["best"] or "-")]
        if not interp:
            cols.append(("x BSP", lambda e: fmt(e["speedup_vs_bsp"], 2)))
            if any(e["alternative"] for e in entries):
                cols.append(("x alt", lambda e: fmt(e["speedup_vs_alternative"], 2)))
                cols.append(("own", lambda e: e.get("own") or "-"))
                cols.append(("own/alt", lambda e: fmt(e.get("own_vs_alternative"), 2)))
        if any(e.get("bound_us") is not None for e in entries):
            cols.append(("bound", lambda e: fmt(e.get("bound_us"))))
            if not interp:
                cols.append(("ceiling", lambda e: fmt(e["ceiling"], 2)))
        stale = any(e.get("stale") for e in entries)
        if stale:
            cols.append(("stale", lambda e: "stale" if e.get("stale") else ""))
        unconfirmed = any(e.get("unconfirmed") for e in entries)
        alt_unconfirmed = any(e.get("unconfirmed_alt") for e in entries)
        if unconfirmed or alt_unconfirmed:
            cols.append(("check", lambda e: "unconfirmed" if e.get("unconfirmed")
                         else "alt unconfirmed" if e.get("unconfirmed_alt") else ""))
        star = lambda e, v: "*" if e.get("timed_eager", {}).get(v) else ""  # noqa: E731
        body = [[*cells[e["problem"]], *[fmt(e["us"].get(v)) + star(e, v) for v in variants], *[f(e) for _, f in cols]]
                for e in entries]
        print_split_table(console, f"{name} {fixed}: {mode} mode, us per call (rank-max median){where}",
                          key_cols, [*variants, *[c for c, _ in cols]], body)
        if stale:
            console.print(STALE_NOTE)
        if any(any(e.get("timed_eager", {}).values()) for e in entries):
            console.print(TIMED_EAGER_NOTE)
        if unconfirmed:
            console.print(UNCONFIRMED_NOTE)
        if alt_unconfirmed:
            console.print(UNCONFIRMED_ALT_NOTE)
    if interpreted:
        console.print(INTERPRETED_NOTE, style="yellow")
    elif table:
        console.print(LEGEND)
