"""Op, problem, variant, config: the concepts every other module is generic over (DESIGN.md).

An *op* (e.g. `ag_gemm`) has a float64 reference, a bulk-synchronous variant `bsp` and other
variants (families: bsp, peer, hybrid, fused). A *problem* is the key dispatch sees: op + named
sizes + dtype + world size. A *variant* declares its search space, its known-good configs and its
validity constraints, and builds a *runner* (autofuse/core/runner.py) for a (problem, config) on a
World. A *config* is a plain dict of the variant's parameters. The registry (`autofuse.core.registry`)
maps op name -> Op.
"""
from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

import torch

from autofuse.core.problem import (DTYPES, FP8, OUTPUT_DTYPES, SCALINGS, Config, InvalidConfig, InvalidInput,
                                   Problem, config_key, dtype_name)

if TYPE_CHECKING:
    from autofuse.core.custom import CustomOp
    from autofuse.core.runner import Runner
    from autofuse.core.contracts import World

__all__ = ["DTYPES", "FP8", "OUTPUT_DTYPES", "SCALINGS", "Config", "InvalidConfig", "InvalidInput", "Problem",
           "config_key", "dtype_name", "Op", "Variant", "SearchSpace", "FAMILIES", "default_tolerance", "rel_error",
           "global_sizes", "outside_graph_pool", "in_own_thread"]


class SearchSpace(Protocol):
    """What Optuna's trial offers: the subset of `optuna.Trial` a variant's space uses."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...
    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int: ...


FAMILIES = ("bsp", "peer", "hybrid", "fused")


class Variant:
    """One implementation of an op; subclass it and override the hooks that differ.

    - `family`: `bsp` (collective library + vendor compute), `peer` (torch's own symmetric-memory
      ops), `hybrid` (a one-launch heap collective beside the vendor GEMM), `fused` (one kernel that
      moves tiles itself). Hybrid and fused variants are `tunable`: they have a search space.
    - `space(trial, problem)` draws a config from the variant's search space (Optuna define-by-run).
    - `defaults(problem)` lists known-good configs, enqueued first by the tuner.
    - `check(problem, config)` returns None or the reason the config cannot run (shared memory,
      divisibility, ...); the default accepts only the empty config.
    - `unavailable(world)` says why the variant cannot run on `world` at all (e.g. torch_symm on CPU,
      or where ranks share a GPU), None where it can; `available(world)` is its boolean.
    - `capturable`: whether its calls can be captured in a CUDA graph (True for most; False where the
      host reads device data per call, e.g. MoE's bsp reading the routing counts for its all-to-all
      splits). Graph-mode timing (autofuse/measure/timing.py: `timed_mode`) times a non-capturable
      variant eagerly and marks the measurement `extra["timed_eager"]`: what a user who picks it gets
      (their graph cannot contain it, so it runs eagerly).
    - `runner(world, problem, config)` allocates what the variant needs (heap workspace, compiled
      kernels) and returns a Runner (autofuse/core/runner.py); `build` checks first and raises
      InvalidConfig / InvalidInput, so `runner` may assume a valid config.
    """

    name: str = ""
    family: str = "fused"
    capturable: bool = True

    def __init__(self, name: str | None = None, family: str | None = None):
        self.name = name or self.name
        self.family = family or self.family
        if not self.name or self.family not in FAMILIES:
            raise ValueError(f"variant {self.name!r}: needs a name and a family in {FAMILIES}")

    @property
    def tunable(self) -> bool:
        return self.family in ("hybrid", "fused")

    def unavailable(self, world: World) -> str | None:
        return None

    def available(self, world: World) -> bool:
        return self.unavailable(world) is None

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        return {}

    def defaults(self, problem: Problem) -> list[Config]:
        """The known-good configs to measure first: the empty one of a variant without parameters, or none
        where `check` refuses the problem with it (a dtype or form the variant has no kernel for), so that
        the tuner measures nothing there and dispatch never picks the variant for it."""
        return [] if self.check(problem, {}) else [{}]

    def check(self, problem: Problem, config: Config) -> str | None:
        return f"{self.name} takes no config, got {config_key(config)}" if config else None

    def refuses(self, world: World, problem: Problem, config: Config) -> str | None:
        """Why this World (its heap, its devices) cannot run a config that `check` accepts, or None;
        the tuner asks it before launching anything, so such configs are never measured."""
        return None

    def runner(self, world: World, problem: Problem, config: Config) -> "Runner":
        raise NotImplementedError(f"{self.name} builds no runner")

    def build(self, world: World, problem: Problem, config: Config) -> "Runner":
        """Check (`check`, then `refuses` for this World), then build this variant's runner for `problem` on
        `world` (collective; every rank refuses alike, before any collective).

        Built outside inference mode and outside any CUDA graph's memory pool whatever the caller's
        state: a runner's buffers outlive the call that built it, and buffers made under
        `torch.inference_mode()` (an inference server's warm-up) could not be written by later calls
        made outside it, while buffers made during torch.compile's CUDA-graph warm-up
        (mode="reduce-overhead") would sit in the graph's private pool, untracked, which torch refuses
        ("tensor(s) in the cudagraph pool not tracked as outputs")."""
        if problem.world != world.size:
            raise InvalidInput(f"{problem.op}: problem is for {problem.world} ranks, this World has {world.size}")
        why = self.unavailable(world)
        if why:
            raise InvalidConfig(f"{problem.op}.{self.name} is not available: {why}")
        reason = self.check(problem, config) or self.refuses(world, problem, config)
        if reason:
            raise InvalidConfig(f"{problem.op}.{self.name}: {reason}")
        def make() -> "Runner":
            with torch.inference_mode(False):  # thread-local: set where the runner is made
                return self.runner(world, problem, dict(config))

        return outside_graph_pool(world.device, make)

    def __repr__(self) -> str:
        return f"<{self.family} variant {self.name}>"


T = TypeVar("T")


def outside_graph_pool(device: torch.device, fn: Callable[[], T]) -> T:
    """fn() with its CUDA allocations in the caching allocator's ordinary pool, never in a CUDA
    graph's private pool: torch.compile's cudagraph trees route every allocation of the *thread*
    that warms a graph up to that pool (torch._C._cuda_beginAllocateCurrentThreadToPool), so on
    CUDA fn runs in a short-lived thread of its own, on the caller's device and stream (its kernels
    and collectives stay ordered as if called inline); the caller waits for it and gets its result
    or its exception. Called inline off CUDA and while the stream is
    captured (dispatch builds nothing then), and in processes that never loaded torch.compile's
    CUDA-graph trees (no pool to escape)."""
    if (device.type != "cuda" or "torch._inductor.cudagraph_trees" not in sys.modules
            or torch.cuda.is_current_stream_capturing()):
        return fn()
    stream = torch.cuda.current_stream(device)

    def on_callers_stream() -> T:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return fn()

    return in_own_thread(on_callers_stream)


def in_own_thread(fn: Callable[[], T]) -> T:
    """fn() run in a new thread while the caller waits: its result, or its exception raised here."""
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=work, name="autofuse-build")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclass
class Op:
    """A distributed operation: its inputs, float64 reference, tolerance and variants.

    - `problem_of(world, *inputs)` validates call arguments and returns their Problem (raises
      InvalidInput with a reason otherwise); dispatch calls it on every call, so keep it cheap.
    - `inputs(world, problem, seed)` makes this rank's random inputs (never zeros), on the
      World's device, deterministic in (seed, rank) so any rank can rebuild any rank's inputs.
    - `reference(world, problem, seed)` is this rank's expected output in float64.
    - `tolerance(problem)` is the allowed ||out - ref|| / ||ref|| for the problem's dtype and K.
    - `features(problem)` are the numbers the policy learns from.
    - `sweep(kind, world)` lists problems to tune/bench (kinds: the op's docstring).
    - `args` names the public entry point's tensor arguments in order (`autofuse.<op>(*args, group=...)`).
    - `optional` names keyword-only tensor arguments of the entry point (None by default) that, when
      given, follow `args` as inputs: the FP8 scales (`autofuse.gemm_ar(a, b, group=..., scale_a=...,
      scale_b=...)` calls problem_of and the runner with (a, b, scale_a, scale_b)).
    - `per_rank` names the dims given per rank (the global size along them is the dim times the
      world size; every other dim is global): strong scaling compares problems of equal global size.
    - `bound(world, problem, seed)` returns the BSP baseline's pieces as callables (e.g. the matmul
      alone, the collective alone), which `autofuse bench` times to show the bound: the sum of the
      pieces is what BSP pays, their maximum what perfect overlap would pay.
    - `bytes_read(problem)` and `copy_rate(world, problem)` (memory-bound ops): the bytes a call must
      read, and a callable that copies as many bytes on the device, so the bench reports the
      achieved share of the memory bandwidth measured in the same run.
    - `custom` (autofuse/core/custom.py) declares what the op's torch custom op needs beyond `args`:
      the output's shape for the fake implementation, named extra outputs, the backward; the custom-op
      layer (autofuse/library) registers `torch.ops.autofuse.<name>` from it. None: no custom op (a
      call that needs one, an input requiring grad or a trace, raises).

    Beyond one tensor in, one out (what MoE's dispatch/combine pair needs; one-output ops set none):
    - `outputs` names the outputs; with more than one, runners return `Outputs` (a tuple, each
      also read by its name) and `reference` returns one tensor per name, in order.
    - `partner` names the op whose call makes the `Handle` this op takes, and `handles` names those
      of `args` that are handles (autofuse/core/runner.py): host objects, never tensors, that the
      cache key reads by their static `key` and the library path never treats as an input to trace
      or differentiate.
    - `capacities` names dims that are static upper bounds (e.g. tokens per expert): the tensors are
      sized by them, so a problem (and a CUDA graph) sees static shapes, while the actual counts
      travel as input tensors the kernels read; `problem_of` takes capacities from shapes, never
      from the counts' values (that would need a device sync and change the key per call).
    - `extra_features` names dims that are not sizes (e.g. a routing skew, bucketed): the policy
      sees each as its value (`core.features`), not as log2 of a size.
    """

    name: str
    args: tuple[str, ...]
    variants: dict[str, Variant] | Sequence[Variant]
    problem_of: Callable[..., Problem]
    inputs: Callable[[World, Problem, int], tuple[torch.Tensor, ...]]
    reference: Callable[[World, Problem, int], torch.Tensor]
    tolerance: Callable[[Problem], float]
    features: Callable[[Problem], dict[str, float]]
    sweep: Callable[[str, int], list[Problem]]
    description: str = ""
    per_rank: tuple[str, ...] = ()
    bound: Callable[[World, Problem, int], dict[str, Callable[[], Any]]] | None = None
    bytes_read: Callable[[Problem], int] | None = None
    copy_rate: Callable[[World, Problem], Callable[[], Any]] | None = None
    optional: tuple[str, ...] = ()
    custom: CustomOp | None = None
    outputs: tuple[str, ...] = ("out",)
    partner: str | None = None
    handles: tuple[str, ...] = ()
    capacities: tuple[str, ...] = ()
    extra_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        stray = [h for h in self.handles if h not in self.args]
        if stray or (self.handles and not self.partner) or not self.outputs:
            raise ValueError(f"op {self.name}: handles {stray or list(self.handles)} must be among args "
                             f"{list(self.args)} and come with a partner op; outputs must name at least one")
        clash = set(self.capacities) & set(self.per_rank) | set(self.extra_features) & set(self.capacities)
        if clash:
            raise ValueError(f"op {self.name}: dims {sorted(clash)} are declared twice (capacities, per_rank, "
                             "extra_features)")
        if not isinstance(self.variants, dict):
            self.variants = {v.name: v for v in self.variants}

    def variant(self, name: str) -> Variant:
        try:
            return self.variants[name]
        except KeyError:
            raise KeyError(f"{self.name} has no variant {name!r}; it has {sorted(self.variants)}") from None

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A registered op pickles as its registry entry (name, module), as a function pickles as its
        name: its declarations hold functions (lambdas among them) that pickle cannot carry, and a
        spawned rank needs the op its module defines, not a copy. Other ops pickle field by field. The
        registry is read where it is loaded (a registered op's process has it); this module does not
        import it: the registry names ops, ops do not know the registry."""
        registry = sys.modules.get("autofuse.core.registry")
        module = registry.MODULES.get(self.name) if registry is not None else None
        if module is not None and getattr(sys.modules.get(module), "OP", None) is self:
            return registry.registered, (self.name, module)
        return super().__reduce_ex__(protocol)


def global_sizes(problem: Problem, per_rank: Sequence[str]) -> str:
    """'op|dims|dtype' of `problem` with its `per_rank` dims scaled to global sizes (dim x world):
    the same string at every world size for the same global work."""
    dims = ",".join(f"{k}={v * problem.world if k in per_rank else v}" for k, v in problem.dims)
    return f"{problem.op}|{dims}|{problem.dtype}"


REL_ERROR_CHUNK = 1 << 24  # elements per float64 chunk of rel_error (128 MiB each)


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64; inf if `out` holds NaN/inf (e.g. poison left unwritten).
    Several outputs (a tuple, e.g. `Outputs`, against one reference per output): the largest error; an
    output whose reference is None (a handle: its partner's output checks it) is not compared."""
    if isinstance(out, (tuple, list)):
        if not isinstance(ref, (tuple, list)) or len(ref) != len(out):
            raise ValueError(f"{len(out)} outputs against a reference of {len(ref) if isinstance(ref, (tuple, list)) else 1}")
        return max(rel_error(o, r) for o, r in zip(out, ref) if r is not None)
    o, r = out.detach(), ref.detach()
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
    if r.device != o.device:
        r = r.to(o.device)
    o, r = o.reshape(-1), r.reshape(-1)
    # On the output's device, in float64 chunks (bounded memory), one host sync at the end: copying a
    # large output and reference to the host was most of a tuning trial's check on GPUs.
    sums = torch.zeros(3, dtype=torch.float64, device=o.device)  # non-finite count, |o - r|^2, |r|^2
    for start in range(0, o.numel(), REL_ERROR_CHUNK):
        oc = o[start:start + REL_ERROR_CHUNK].to(torch.float64)
        rc = r[start:start + REL_ERROR_CHUNK].to(torch.float64)
        sums += torch.stack([(~torch.isfinite(oc)).sum().to(torch.float64), (oc - rc).square().sum(), rc.square().sum()])
    bad, num, den = sums.tolist()
    if bad:
        return float("inf")
    return math.sqrt(num) / (math.sqrt(den) if den > 0 else 1.0)


def default_tolerance(dtype: str, k: int) -> float:
    """Relative-error bound for a K-long dot product in `dtype`, accumulated in float32.

    Inputs are rounded to the dtype (unit roundoff u: 2^-8 bf16, 2^-11 fp16, ~tf32 2^-11 for fp32
    dots on tensor cores); the relative error of a random-sign sum grows like u * sqrt(log K)
    at worst, so a small constant times u, floor-bounded, covers every K we run.
    FP8 (float8_e4m3fn): the float64 reference multiplies the FP8 values themselves (dequantised:
    times the scales), so input rounding is no error; the output is bfloat16, hence bfloat16's u
    (the GPU's fast FP8 accumulation adds far less at the K we run).
    """
    u = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -8}[dtype]
    return 4 * u * max(1.0, (max(k, 2).bit_length() / 8) ** 0.5)
