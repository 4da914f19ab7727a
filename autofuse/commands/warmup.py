"""`autofuse warmup`: pay every first-call decision, confirmation and compile of a model's shapes ahead of
serving, on all local ranks (autofuse/dispatch/warmup.py says what later processes keep)."""
from __future__ import annotations

import json
from typing import Any, Optional

import typer

from autofuse.commands._common import fail, note, out

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256"


def _warm_rank(world: Any, keys: list[str]) -> dict:
    """One rank of the job: the first call of every problem, in order (autofuse.warmup_problems)."""
    from autofuse.dispatch.warmup import warmup_problems

    return warmup_problems(keys, world).as_dict()


def _ints(text: str, what: str) -> list[int]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        fail(f"{what} must be comma-separated positive counts, e.g. 1,2,4,8; got {text!r}")
    return [int(s) for s in items]


def _dims(text: str) -> dict[str, Any]:
    """'N=4096,K=14336' as {'N': 4096, 'K': 14336} (numbers as ints, anything else as text)."""
    dims: dict[str, Any] = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            fail(f"--shapes takes NAME=VALUE items separated by commas (e.g. N=4096,K=14336), got {text!r}")
        value = value.strip()
        dims[name.strip()] = int(value) if value.isdigit() else value
    return dims


def problems_of(op: Optional[str], shapes: list[str], model: Optional[str], tokens: Optional[str], world: int,
                sequence_parallel: bool, dtype: str) -> list:
    """The problems to warm up, from --model or --op/--shapes and --tokens (fails with one line on bad input)."""
    from autofuse.core import registry
    from autofuse.core.op import InvalidInput, Problem
    from autofuse.dispatch.warmup import preset_problems, token_dim

    if (model is None) == (op is None):
        fail("give either --model (a preset: its layer's shapes) or --op with --shapes")
    if model is not None:
        if shapes:
            fail("--shapes goes with --op; --model takes its shapes from the preset")
        try:
            return preset_problems(model, world, _ints(tokens or DEFAULT_TOKENS, "--tokens"), sequence_parallel, dtype)
        except (ValueError, InvalidInput) as exc:
            fail(str(exc))
    if op not in registry.names():
        fail(f"unknown op {op!r}: known ops are {', '.join(registry.names())}")
    if not shapes:
        fail(f"--op {op} needs --shapes (e.g. --shapes N=4096,K=14336 --tokens 1,2,4)")
    dim = token_dim(op)
    counts = _ints(tokens, "--tokens") if tokens else None
    found = []
    for text in shapes:
        dims = _dims(text)
        if op == "ag_gemm":
            dims.setdefault("gather", "rows")
        if (dim in dims) == (counts is not None):
            fail(f"--shapes {text!r}: give {op}'s {dim} either in --shapes or as --tokens, exactly one of the two")
        try:
            for t in counts or [dims[dim]]:
                found.append(Problem.make(op, dtype, world, **{**dims, dim: t}))
        except InvalidInput as exc:
            fail(f"--shapes {text!r}: {exc}")
    return list(dict.fromkeys(found))


def warmup(
    model: Optional[str] = typer.Option(None, "--model", help="A model preset whose decoder layer's shapes to "
                                        "warm (llama3-8b, llama3-70b, llama3-405b, qwen2.5-72b, mixtral-8x7b)."),
    op: Optional[str] = typer.Option(None, "--op", help="One op to warm (with --shapes)."),
    shapes: Optional[list[str]] = typer.Option(None, "--shapes", help="With --op, repeatable: the problem's dims "
                                               "as NAME=VALUE items, e.g. N=4096,K=14336 (GEMM ops; M from "
                                               "--tokens, or given here) or Hq=32,Hkv=8,D=128,S=8192 "
                                               "(flash_decode; B from --tokens)."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Comma-separated token counts (the rows M of "
                                         "the GEMM ops, the batch B of flash_decode): a server's batch sizes, "
                                         f"as vLLM's capture sizes (with --model, default {DEFAULT_TOKENS})."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="With --model: the layer as "
                                           "sequence parallel (ag_gemm + gemm_rs) instead of gemm_ar."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The problems' dtype (bfloat16, float16, float32, "
                              "float8_e4m3fn)."),
    world: Optional[int] = typer.Option(None, "--world", min=1, help="World size (default: every local GPU, "
                                        "or 2 CPU ranks)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Make every first-call decision, confirmation and compile of the given shapes now, on all local ranks.

    Confirmations go to the online store and compiled kernels to Triton's cache, so a later serving
    process's first request of a warmed shape neither confirms nor compiles. On the CPU emulation
    (confirmation off unless AUTOFUSE_ONLINE=1) it decides, builds and runs each problem once.
    """
    from autofuse.comm.world import RankFailed, default_device_kind, gpu_count, spawn

    kind = default_device_kind()
    n = world or (gpu_count() if kind == "cuda" else 2)
    if kind == "cuda" and n > gpu_count():
        fail(f"--world {n} needs {n} GPUs; {gpu_count()} are visible")
    found = problems_of(op, list(shapes or []), model, tokens, n, sequence_parallel, dtype)
    where = "GPU" if kind == "cuda" else "CPU"
    note(f"warmup: {len(found)} problems on {n} {where} ranks", style="")
    try:
        reports = spawn(_warm_rank, n, [p.key for p in found], device_kind=kind, timeout_s=3600.0)
    except (RankFailed, ValueError) as exc:
        fail(f"warmup failed: {(str(exc).strip().splitlines() or [''])[0]}")
    report = dict(reports[0], rank_seconds=[r["seconds"] for r in reports])
    if json_out:
        print(json.dumps(report, indent=1, sort_keys=True))
        return
    for p in report["problems"]:
        mark = " (confirmed now)" if p["confirmed_now"] else ""
        out.print(f"{p['problem']}: {p['variant']} [{p['basis']}] {p['seconds'] * 1e3:.0f} ms{mark}", soft_wrap=True)
    where_kept = (f"confirmations recorded in {report['online_db']}" if report["confirmation"] else
                  "confirmation is off here (CPU emulation, AUTOFUSE_ONLINE=0 or ranks sharing a GPU): the decisions "
                  "are the policy's, made again without timing by every process")
    note(f"warmed {len(report['problems'])} problems in {max(report['rank_seconds']):.1f} s, "
         f"{report['confirmations']} confirmed now; {where_kept}", style="green")


def register(app: typer.Typer) -> None:
    app.command()(warmup)
