"""Settings: every AUTOFUSE_* environment variable, read and validated in one place, and the default
places autofuse reads and writes (`OUT_DIR`, `DEFAULT_DB`, `online_db`, `user_models_dir`).

Each reader parses the environment when it is called (tests, benches and servers change the
environment between calls; none of these is read on a cached call's hot path, but for the CPU
emulation's bsp collectives, which read the wait budget) and raises
`SettingError` (a ValueError) naming the variable and what it accepts. `NAMES` documents them all;
`lockstep(device)` parses every setting the ranks of a job must share, which a first call's
agreement compares (autofuse.dispatch.agreement).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable

from autofuse.core import modes

NAMES = {
    "AUTOFUSE_VARIANT": "op:variant[,op:variant...] (or *:variant): force variants (debugging)",
    "AUTOFUSE_POLICY": "path of a policy JSON to use instead of searching the models folders",
    "AUTOFUSE_MODELS_DIR": "extra folders searched first for policies (os.pathsep-separated)",
    "AUTOFUSE_MODE": "graph | eager: the timing mode decisions are made for (default graph on GPUs)",
    "AUTOFUSE_TRAIN_MODE": "eager | graph: the timing mode training calls (autograd records them or runs them in a "
                           "backward) are decided for (default eager; graph where the training step is CUDA-graph "
                           "replayed)",
    "AUTOFUSE_ONLINE": "1 | 0: confirm predicted decisions by measuring on first use (default on GPUs)",
    "AUTOFUSE_CONFIRM_K": "1..16: candidates measured beside BSP when confirming (default 3)",
    "AUTOFUSE_ONLINE_DB": "path of this machine's online store of confirmed measurements",
    "AUTOFUSE_CHECK": "1: read the fault record after every call (a device sync), not only the first",
    "AUTOFUSE_WAIT_TIMEOUT": "seconds a flag wait may take (default 10 on GPUs, 120 on CPU)",
    "AUTOFUSE_HEAP_SIZE": "symmetric heap size per rank: bytes or a number with K, M or G",
    "AUTOFUSE_HEAP_PROVIDER": "symm | torch | iris | shm: the symmetric heap's provider",
    "AUTOFUSE_HEAP_TIMEOUT": "seconds a heap rendezvous waits for the other ranks (default 300)",
    "AUTOFUSE_RANKS_PER_GPU": "tests and diagnostics: up to N ranks share each GPU (gloo, IPC heap, no timing)",
    "AUTOFUSE_SAVE_GATHERED": "1 | 0: a differentiable ag_gemm keeps all_gather(A) for backward (default 1) "
                              "or gathers it again there",
    "AUTOFUSE_RING_MIN_GFLOP": "GFLOP per rank below which gemm_rs's mm_ring refuses a problem at CHUNKS=2 "
                               "(default 300; x (1 + CHUNKS) / 3 at other CHUNKS; 0 where every call is graph-replayed)",
}
DEFAULT_WAIT_TIMEOUT_S = {"cuda": 10.0, "cpu": 120.0}  # the interpreter runs a peer's programs one by one
MAX_SECONDS = 7 * 24 * 3600.0  # a week: beyond it a wait budget overflows the kernels' int64 nanoseconds
DEFAULT_HEAP_TIMEOUT_S = 300.0
HEAP_PROVIDERS = ("torch", "symm", "iris", "shm")
MIN_HEAP_SIZE = 1 << 16
MAX_HEAP_SIZE = 1 << 40
DEFAULT_CONFIRM_K = 3
DEFAULT_RING_MIN_GFLOP = 300.0
# Everything the commands write by default goes under ./autofuse-out/ (git-ignored) or the user data
# folder (policies): the checkout's tuning_db/ and models/ hold shipped files only.
OUT_DIR = Path("autofuse-out")
DEFAULT_DB = OUT_DIR / "autofuse.db"


class SettingError(ValueError):
    """An AUTOFUSE_* variable holds a value autofuse cannot use; the message names it."""


def _text(name: str) -> str:
    return os.environ.get(name, "").strip()


def _number(name: str, default: float, ok: Callable[[float], bool], not_number: str, out_of_range: str) -> float:
    """`name`'s value as a finite float accepted by `ok`, else `default` where unset; SettingError otherwise,
    with `not_number` or `out_of_range` after "NAME='text'"."""
    text = _text(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingError(f"{name}={text!r}{not_number}") from None
    if not (math.isfinite(value) and ok(value)):
        raise SettingError(f"{name}={text!r}{out_of_range}")
    return value


def _seconds(name: str, default: float) -> float:
    return _number(name, default, lambda v: 0 < v <= MAX_SECONDS, " is not a number of seconds (e.g. 10 or 0.5)",
                   f" must be a positive number of seconds, at most {MAX_SECONDS:.0f}")


def wait_timeout_s(device_type: str) -> float:
    """Seconds a flag wait may take: AUTOFUSE_WAIT_TIMEOUT, else a default per device kind."""
    return _seconds("AUTOFUSE_WAIT_TIMEOUT", DEFAULT_WAIT_TIMEOUT_S[device_type])


def heap_timeout_s() -> float:
    """Seconds a heap rendezvous waits for the group's other ranks: AUTOFUSE_HEAP_TIMEOUT, else 300."""
    return _seconds("AUTOFUSE_HEAP_TIMEOUT", DEFAULT_HEAP_TIMEOUT_S)


def parse_size(text: str | int) -> int:
    """'64M', '2G', '1048576' -> bytes (AUTOFUSE_HEAP_SIZE's syntax); at least MIN_HEAP_SIZE."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", str(text))
        if not m:
            raise SettingError(f"cannot read heap size {text!r} (AUTOFUSE_HEAP_SIZE): use bytes or a number with "
                               "K, M or G, e.g. 512M or 8G")
        size = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    if size < MIN_HEAP_SIZE:
        raise SettingError(f"heap size {text!r} (AUTOFUSE_HEAP_SIZE) is below the minimum of {MIN_HEAP_SIZE >> 10}K")
    if size > MAX_HEAP_SIZE:
        raise SettingError(f"heap size {text!r} (AUTOFUSE_HEAP_SIZE) is above the maximum of {MAX_HEAP_SIZE >> 40}T")
    return size


def heap_size() -> int | None:
    """AUTOFUSE_HEAP_SIZE in bytes, None if unset (the heap picks its default per device)."""
    text = _text("AUTOFUSE_HEAP_SIZE")
    return parse_size(text) if text else None


def heap_provider() -> str | None:
    """AUTOFUSE_HEAP_PROVIDER, None if unset (the heap picks its default per device and group)."""
    text = _text("AUTOFUSE_HEAP_PROVIDER")
    if text and text not in HEAP_PROVIDERS:
        raise SettingError(f"AUTOFUSE_HEAP_PROVIDER={text!r}: use one of {', '.join(HEAP_PROVIDERS)}")
    return text or None


def _switch(name: str) -> bool | None:
    text = _text(name)
    if text in ("0", "1"):
        return text == "1"
    if text:
        raise SettingError(f"{name}={text!r}: use 1 or 0")
    return None


def online(device_type: str, shares_gpu: bool = False) -> bool:
    """Whether first calls confirm predictions by measuring: AUTOFUSE_ONLINE, else on for GPUs; never
    where ranks share a GPU (their timings mean nothing), where asking for it is an error."""
    value = _switch("AUTOFUSE_ONLINE")
    if shares_gpu:
        if value:
            raise SettingError(f"AUTOFUSE_ONLINE=1 asks to confirm decisions by timing them, and ranks share a GPU "
                               f"here (AUTOFUSE_RANKS_PER_GPU={ranks_per_gpu()}), where timings mean nothing: "
                               "unset one of the two")
        return False
    return device_type == "cuda" if value is None else value


def check_every_call() -> bool:
    """AUTOFUSE_CHECK=1: read the fault record after every call of a problem, not only its first."""
    return bool(_switch("AUTOFUSE_CHECK"))


def save_gathered(strict: bool = True) -> bool:
    """AUTOFUSE_SAVE_GATHERED (default 1): whether a differentiable ag_gemm keeps all_gather(A) from the
    forward for B's gradient (as torch's async TP does) or keeps only A and gathers it again in backward.
    `strict=False` reads a bad value as the default instead of raising (while torch.compile traces, where
    nothing can be told to the other ranks: the first call's agreement raises it, `lockstep`)."""
    if not strict and _text("AUTOFUSE_SAVE_GATHERED") not in ("", "0", "1"):
        return True
    value = _switch("AUTOFUSE_SAVE_GATHERED")
    return True if value is None else value


def confirm_k() -> int:
    """How many candidates besides BSP a confirmation measures: AUTOFUSE_CONFIRM_K (1..16), default 3."""
    text = _text("AUTOFUSE_CONFIRM_K") or str(DEFAULT_CONFIRM_K)
    if not text.isdigit() or not 1 <= int(text) <= 16:
        raise SettingError(f"AUTOFUSE_CONFIRM_K={text!r}: a number of candidates in 1..16")
    return int(text)


def ring_min_gflop() -> float:
    """AUTOFUSE_RING_MIN_GFLOP (>= 0, default 300): the per-rank GFLOP below which gemm_rs's mm_ring refuses a
    problem at CHUNKS=2 (x (1 + CHUNKS) / 3 at other CHUNKS: gemm_rs.ring_floor). Its calls cost 0.3-1 ms of
    host work, growing with CHUNKS (two H200, 2026-11-30), which pace a call that is not
    replayed from a CUDA graph (eager code, compiled training) where the GPU work is shorter; 0 lets
    code whose calls are all graph-replayed take it on every size."""
    why = ": GFLOP per rank, a number >= 0"
    return _number("AUTOFUSE_RING_MIN_GFLOP", DEFAULT_RING_MIN_GFLOP, lambda v: v >= 0, why, why)


def ranks_per_gpu() -> int:
    """AUTOFUSE_RANKS_PER_GPU (1..64, default 1): how many ranks autofuse's launchers may put on one GPU.

    For tests and diagnostics on machines with fewer GPUs than ranks (autofuse.comm.world.spawn says
    what changes then); 1 is the normal one-GPU-per-rank setup."""
    text = _text("AUTOFUSE_RANKS_PER_GPU") or "1"
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise SettingError(f"AUTOFUSE_RANKS_PER_GPU={text!r}: a number of ranks per GPU in 1..64")
    return int(text)


def mode(device_type: str) -> str:
    """The timing mode decisions are made for: AUTOFUSE_MODE, else graph on GPUs, eager on CPU.

    The one place where the run-time mode is derived (the tuner's modes are its own option)."""
    text = _text("AUTOFUSE_MODE") or modes.default(device_type)
    if text not in modes.supported(device_type):
        raise SettingError(f"AUTOFUSE_MODE={text!r}: use graph (GPUs) or eager")
    return text


def train_mode(device_type: str) -> str:
    """The timing mode training calls are decided for: AUTOFUSE_TRAIN_MODE, else eager.

    A training call is one autograd records (grad mode on, an input requires grad) or runs in a backward.
    A training step, eager or compiled, is run rather than replayed from a CUDA graph, so each call's host
    work (its launches) counts beside its GPU time: eager timings hold both, graph timings GPU time alone.
    graph: for steps captured in CUDA graphs (torch.compile's mode="reduce-overhead")."""
    text = _text("AUTOFUSE_TRAIN_MODE") or "eager"
    if text not in modes.supported(device_type):
        raise SettingError(f"AUTOFUSE_TRAIN_MODE={text!r}: use eager, or graph (GPUs only)")
    return text


def parse_variants(text: str, source: str = "AUTOFUSE_VARIANT") -> dict[str, str]:
    """'op:variant,op:variant' (or '*:variant' for every op) as {op or '*': variant}; the last item of
    an op wins, the first '*' item wins."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, variant = item.partition(":")
        if not sep or not variant or not name:
            raise SettingError(f"{source}={text!r}: items are op:variant (or *:variant), got {item!r}")
        if name != "*" or "*" not in out:
            out[name] = variant
    return out


def variant_override(op: str) -> str | None:
    """The variant AUTOFUSE_VARIANT forces for `op` (an `op:` item wins over `*:`), None if none."""
    forced = parse_variants(os.environ.get("AUTOFUSE_VARIANT", ""))
    return forced.get(op, forced.get("*"))


def variant_text() -> str:
    """AUTOFUSE_VARIANT as written (for messages)."""
    return os.environ.get("AUTOFUSE_VARIANT", "")


def policy_path() -> Path | None:
    """AUTOFUSE_POLICY as a path, None if unset."""
    text = _text("AUTOFUSE_POLICY")
    return Path(text) if text else None


def models_dirs() -> list[Path]:
    """AUTOFUSE_MODELS_DIR's folders, in order."""
    return [Path(p) for p in os.environ.get("AUTOFUSE_MODELS_DIR", "").split(os.pathsep) if p.strip()]


def online_db(hardware_id: str) -> Path:
    """This machine's online store: AUTOFUSE_ONLINE_DB, else <user cache>/autofuse/online-<hardware id>.db."""
    text = _text("AUTOFUSE_ONLINE_DB")
    if text:
        return Path(text)
    return user_cache_dir() / f"online-{hardware_id}.db"


def user_cache_dir() -> Path:
    """autofuse's folder in the user cache: $XDG_CACHE_HOME/autofuse, else ~/.cache/autofuse."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "autofuse"


def user_models_dir() -> Path:
    """Where `autofuse fit` writes policies by default and dispatch looks: $XDG_DATA_HOME/autofuse/models,
    else ~/.local/share/autofuse/models."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "autofuse" / "models"


def lockstep(device_type: str) -> dict[str, object]:
    """Every setting the ranks of a job must share, parsed (SettingError names the first one that cannot
    be used), those that change what the ranks exchange included (AUTOFUSE_SAVE_GATHERED: which calls a
    training step makes): what a first call's agreement compares, so a bad or differing value raises on every rank
    before any heap, workspace or kernel is made (a bad value on one rank would otherwise make the
    others wait in the heap's rendezvous)."""
    return {"AUTOFUSE_WAIT_TIMEOUT": wait_timeout_s(device_type), "AUTOFUSE_HEAP_SIZE": heap_size(),
            "AUTOFUSE_HEAP_PROVIDER": heap_provider(), "AUTOFUSE_HEAP_TIMEOUT": heap_timeout_s(),
            "AUTOFUSE_CHECK": check_every_call(), "AUTOFUSE_MODE": mode(device_type),
            "AUTOFUSE_TRAIN_MODE": train_mode(device_type),
            "AUTOFUSE_ONLINE": online(device_type), "AUTOFUSE_CONFIRM_K": confirm_k(),
            "AUTOFUSE_RANKS_PER_GPU": ranks_per_gpu(), "AUTOFUSE_SAVE_GATHERED": save_gathered()}
