"""`autofuse doctor`: what this machine has, and whether every device primitive works across its ranks."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from autofuse.bench.tables import fmt, print_split_table
from autofuse.commands._common import OutputExists, check_new, console_for, fail, write_new


def _rank_job(world, measure: bool) -> dict:
    from autofuse.comm import selftest

    checks = selftest.check_primitives(world)
    timeout, _ = selftest.check_timeout(world)
    out = {
        "rank": world.rank,
        "provider": world.heap.provider,
        "heap_bytes": world.heap.size,
        "checks": [(c.name, c.ok, c.detail) for c in checks],
        "bounded_wait": str(timeout) if timeout else "",
    }
    if measure:
        out["link"] = selftest.measure_link(world)
    return out


def policy_rows(kind: str, fingerprint: dict) -> list[tuple[str, str]]:
    """(label, what dispatch would load) for each timing mode calls are decided in here: other calls'
    (AUTOFUSE_MODE) and training calls' (AUTOFUSE_TRAIN_MODE), the policy file found for it (a file fitted
    in the other mode where none of its own exists) or why there is none."""
    from autofuse.core import settings
    from autofuse.dispatch.policy import read_file
    from autofuse.dispatch.policy_files import policy_file

    rows = []
    for calls, read in (("calls", settings.mode), ("training calls", settings.train_mode)):
        try:
            mode = read(kind)
        except settings.SettingError as exc:
            rows.append((f"policy for {calls}", f"unusable setting: {exc}"))
            continue
        path = policy_file(fingerprint, mode)
        if path is None:
            what = "none fitted on this hardware kind: BSP for every op (autofuse tune, then autofuse fit)"
        else:
            data, why = read_file(path)
            fitted = data.get("mode") if isinstance(data, dict) else None
            what = (f"{path}: unusable ({why})" if data is None else f"{path}"
                    + (f" (fitted in {fitted} mode: none of {mode} mode found)" if fitted not in (None, mode) else ""))
        rows.append((f"policy for {calls} ({mode} mode)", what))
    return rows


def doctor(
    world: Optional[int] = typer.Option(None, "--world", min=1, help="World size: ranks to run (default: every "
                                        "local GPU, or 2 CPU ranks)."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Also write the report as JSON to this file."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    skip_link: bool = typer.Option(False, help="Skip the bandwidth and latency measurements."),
    force: bool = typer.Option(False, "--force", help="Replace the --out file if it exists."),
) -> None:
    """Report GPUs, links, versions and heap provider; run every device primitive on all local ranks."""
    import torch
    import triton

    from autofuse.measure import environment
    from autofuse.comm.world import RankFailed, default_device_kind, gpu_count, spawn

    console = console_for(stderr=json_out)  # with --json, stdout holds only the JSON
    if out_path is not None:
        check_new([out_path], force)
    kind = default_device_kind()
    n = world or (gpu_count() if kind == "cuda" else 2)
    if kind == "cuda" and n > gpu_count():
        fail(f"--world {n} needs {n} GPUs; {gpu_count()} are visible")
    fp = environment.fingerprint(kind)
    nccl = fp.get("nccl") or "-"
    info = Table(title="autofuse doctor", show_header=False)
    info.add_column(overflow="fold")
    info.add_column(overflow="fold")
    info.add_row("device", "CUDA GPUs" if kind == "cuda" else "no GPU: CPU emulation (shm heap, Triton interpreter)")
    for i in range(gpu_count()):
        p = torch.cuda.get_device_properties(i)
        info.add_row(f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    info.add_row("driver / CUDA", f"{fp.get('driver') or '-'} / {fp.get('cuda') or '-'}")
    info.add_row("torch / Triton / NCCL", f"{torch.__version__} / {triton.__version__} / {nccl}")
    info.add_row("python", platform.python_version())
    info.add_row("fingerprint", fp["id"])
    policies = policy_rows(kind, fp)
    for label, what in policies:
        info.add_row(label, what)
    console.print(info)
    topo = environment.topology_matrix()
    if topo:
        console.print("link topology (nvidia-smi topo -m)", style="bold")
        console.print(topo)
    console.print(f"running the device primitives on {n} {'GPU' if kind == 'cuda' else 'CPU'} ranks ...")
    try:
        results = spawn(_rank_job, n, not skip_link, device_kind=kind, timeout_s=600)
    except RankFailed as exc:
        fail(f"doctor: {(str(exc).strip().splitlines() or [''])[0]}")
    console.print(f"heap provider: {results[0]['provider']} ({results[0]['heap_bytes'] >> 20} MiB per rank)")
    body = [[name, *["ok" if res["checks"][i][1] else f"FAIL: {res['checks'][i][2]}" for res in results]]
            for i, (name, _, _) in enumerate(results[0]["checks"])]
    body.append(["bounded wait -> error", *["ok" if res["bounded_wait"] else "FAIL: no error" for res in results]])
    print_split_table(console, "device primitives", ["check"], [f"rank {r}" for r in range(n)], body)
    failed = any(not c[1] for res in results for c in res["checks"]) or any(not res["bounded_wait"] for res in results)
    if not skip_link and n >= 2:
        body = [[str(res["rank"]), *[fmt(res.get("link", {}).get(k)) for k in
                                     ("pull_GBps", "copy_engine_GBps", "flag_round_trip_us")]] for res in results]
        print_split_table(console, "links (rank r reads rank r+1)", ["rank"],
                          ["pull GB/s", "copy engine GB/s", "flag round trip us"], body)
        if kind == "cpu":
            console.print("(CPU emulation: latencies are the interpreter's, not a GPU's)")
    doc = json.dumps({"fingerprint": fp, "topology": topo, "policies": dict(policies), "world": n, "ranks": results,
                      "ok": not failed},
                     indent=2, default=str) + "\n"
    if out_path:
        try:
            write_new(out_path, doc, force)
        except OutputExists as exc:
            fail(str(exc))
        console.print(f"wrote {out_path}")
    if json_out:
        print(doc, end="")
    if failed:
        console.print("some device primitives failed", style="red")
        raise typer.Exit(1)
    console.print("all device primitives passed", style="green")


def register(app: typer.Typer) -> None:
    app.command()(doctor)
