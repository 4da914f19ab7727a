"""Option handling shared by the extra bench targets that spawn their own ranks and race contenders
(`bench_moe`, `bench_train_layer`, `bench_train_model`; `bench_layer` takes its `setting`), so they read a
command line alike.

`setting(options, cpu_reps)`: the device kind and world (BenchOptions' defaults: every GPU, or 2 CPU
ranks), the timing modes (every mode the device kind has), reps capped at `cpu_reps` on CPU, and the
notes that say what the numbers are (the interpreted note, the cap). `contenders(chosen, known)`:
the contenders picked by `--variants`, checked. `token_counts(items, default, world)`: the token
counts of `--shapes` (or moe's `--tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Setting:
    """What a target runs on: kind ("cuda" | "cpu"), world (ranks), modes, reps (capped on CPU),
    interpreted (CPU emulation: no speedups shown) and notes (one-line strings for the result)."""

    kind: str
    world: int
    modes: list[str]
    reps: int
    interpreted: bool
    notes: list[str] = field(default_factory=list)


def setting(options: Any, cpu_reps: int, interpreted_note: str | None = None) -> Setting:
    """The device kind, world, modes and reps of `options` (a BenchOptions), with the notes they call for
    (`interpreted_note`: the CPU emulation's, where a target says more than compare.INTERPRETED_NOTE)."""
    from autofuse.comm.world import default_device_kind, gpu_count
    from autofuse.core.modes import supported
    from autofuse.measure.compare import INTERPRETED_NOTE, interpreted

    kind = options.device_kind or default_device_kind()
    world = options.world or (gpu_count() if kind == "cuda" else 2)
    reps = options.reps
    notes = [interpreted_note or INTERPRETED_NOTE] if interpreted(kind) else []
    if kind == "cpu" and reps > cpu_reps:
        notes.append(f"reps capped at {cpu_reps} on CPU (asked for {reps})")
        reps = cpu_reps
    return Setting(kind=kind, world=world, modes=list(options.modes or supported(kind)), reps=reps,
                   interpreted=interpreted(kind), notes=notes)


def contenders(chosen: Sequence[str] | None, known: Sequence[str], optional: Sequence[str] = ()) -> list[str]:
    """The contenders `chosen` (`--variants`; None or empty: every one `known`, not the `optional` ones, which
    run only by name), in their order; ValueError naming any unknown."""
    names = list(chosen or known)
    unknown = sorted(set(names) - set(known) - set(optional))
    if unknown:
        raise ValueError(f"unknown contenders {unknown}: choose among {', '.join([*known, *optional])}")
    return names


def token_counts(items: Sequence[str] | None, default: Sequence[int], world: int | None = None) -> list[int]:
    """Token counts from `items` (comma-separated, repeatable, `T=` prefixes allowed), else `default`.
    With `world`, each must split evenly over the ranks (ValueError naming those that do not)."""
    text = ",".join(items or [])
    tokens = [int(t) for t in text.replace("T=", "").split(",") if t.strip()] or list(default)
    bad = [t for t in tokens if world is not None and t % world]
    if bad:
        raise ValueError(f"token counts {bad} are not divisible by the world size {world}")
    return tokens
