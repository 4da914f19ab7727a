"""The public entry points and the hot path: `autofuse.<op>(...)`, `call`, `explain`, `rebuild`.

Hot path (a cached problem): a key from the op name, the group and each input's shape, dtype,
device and contiguity, one dict lookup, the runner call. No I/O, no collective, no policy walk.
Miss path: decide (dispatch/decide.py), agree with every rank (dispatch/agreement.py), confirm a
predicted decision by measuring (dispatch/confirm.py), build the runner, cache it, run it.

Library path: a call whose inputs require grad (grad mode on), or made while torch.compile /
torch.export traces, or on tensor subclasses (FakeTensor, ...) goes to the op's torch custom op
instead (autofuse/library: autograd, fake implementation, one node per call in a graph), which
dispatches on real tensors when it runs (`library_call`: the same key and lookup, without the
library-path test, one lookup per call, extra outputs included). The hot path pays only the test for it. A miss never
decides while tracing (`TraceMiss`) or capturing a CUDA graph (`CaptureMiss`). The custom-op layer
stands above dispatch: it installs itself here at import (`use_library`); dispatch never imports it,
and loads it by the registry's name for it (`core.registry.library`) where nothing did yet.

Handles (`Op.handles`: arguments made by a partner op's call, `core.runner.Handle`) are inputs that
are not tensors: the cache key takes each handle's static `key`, and the library-path test skips them.
"""
from __future__ import annotations

import json
from typing import Any, Callable, NoReturn

import torch

from autofuse.core import modes, registry, settings
from autofuse.core.op import Config, InvalidInput, Op, config_key
from autofuse.core.runner import Handle
from autofuse.dispatch import agreement
from autofuse.dispatch.agreement import agree, told
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.decide import build, confirm, decide
from autofuse.dispatch.state import STATE, Entry, op_of, world_of


class CaptureMiss(RuntimeError):
    """A problem was first seen inside CUDA-graph capture, where dispatch cannot decide it."""


class TraceMiss(RuntimeError):
    """A problem reached dispatch's miss path while a trace runs (torch.compile, torch.export, fake
    tensors), where nothing can be decided, agreed on or built."""


PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor classes the hot path takes; other classes are traced
# The library-path test's functions, as module attributes: the generated entry points' namespace bears
# this module's name, and Dynamo, tracing one, reads its globals from the module of that name.
grad_enabled = torch.is_grad_enabled
compiling = torch.compiler.is_dynamo_compiling


def call(op: str | Op, *args: Any, group: Any = None, variant: str | None = None, config: Config | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Run `op` on this rank's inputs with the chosen (or overridden) variant; every rank must call it.

    `group`: a torch.distributed process group (None: the default group) or an autofuse World.
    """
    name = op if op.__class__ is str else op.name
    if library_path(args):
        try:
            result = route(name, args, group, variant, config, out)
        except Exception as exc:
            tell(group, name, exc, args)
        if result is not None:
            return result
    return dispatched(op, args, group, variant, config, out, None)


def dispatched(op: str | Op, args: tuple, group: Any, variant: str | None, config: Config | None,
               out: torch.Tensor | None, mode: str | None) -> torch.Tensor:
    """`call` below the library-path test: the cached runner, or the miss path deciding for timing `mode`
    (None: AUTOFUSE_MODE's; `training_mode` for a training call)."""
    name = op if op.__class__ is str else op.name
    key = key_of(name, group, variant, config, args, mode)
    entry = STATE.cache.get(key)
    if entry is None:
        return miss(key, op, args, group, variant, config, out, mode)
    STATE.stats.hits += 1
    return run(entry, args, out)


def library_call(name: str, args: tuple, group: Any, variant: str | None, config: str | None,
                 training: bool = False) -> tuple[Any, Entry | None]:
    """`call` for the custom ops' implementations (autofuse/library): the result and the Entry that ran it
    (an extra output reads its runner, `Extra.take`), `config` as the canonical JSON the custom ops take.

    The hot path without the library-path test: an implementation runs below autograd, on real tensors,
    never while Dynamo traces. A training call (`training`: autograd recorded it; or it runs in a backward,
    `in_backward`) is decided in `training_mode`, under a key of its own where that mode is not the
    process's. A miss, a config text that is not canonical, an input that is neither a tensor nor a handle,
    or a running trace takes `dispatched` (key, decision and checks as ever)."""
    mode = training_mode(args) if training or in_backward() else None
    key = None if compiling() else _key(name, group, variant, config, args, mode)
    entry = None if key is None else STATE.cache.get(key)
    if entry is None:
        parsed = None if config is None else json.loads(config)
        result = dispatched(name, args, group, variant, parsed, None, mode)
        return result, STATE.cache.get(key_of(name, group, variant, parsed, args, mode))
    STATE.stats.hits += 1
    return run(entry, args, None), entry


def in_backward() -> bool:
    """Whether autograd's engine runs a backward on this thread (eager or compiled): its calls train."""
    return torch._C._current_graph_task_id() != -1


def training_mode(args: tuple) -> str | None:
    """The timing mode training calls on `args`' device kind are decided in (AUTOFUSE_TRAIN_MODE), or None where
    it is the process's own (AUTOFUSE_MODE: training and other calls of a problem then share one decision).
    Read once per process and kind (`reset` forgets it); a value that cannot be used reads as None here and
    raises at the call's agreement, on every rank (`settings.lockstep`)."""
    first = args[0] if args else None  # the ops' first input is a tensor: one attribute read on the hot path
    kind = first.device.type if isinstance(first, torch.Tensor) else next(
        (a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    if kind is None:
        return None
    if kind not in STATE.train_modes:
        try:
            mode, default = STATE.train_mode or settings.train_mode(kind), settings.mode(kind)
        except settings.SettingError:
            return None
        if mode not in modes.supported(kind):
            raise ValueError(f"autofuse.dispatch.set_train_mode({mode!r}): {kind} times only "
                             f"{' and '.join(modes.supported(kind))} mode")
        STATE.train_modes[kind] = None if mode == default else mode
    return STATE.train_modes[kind]


def set_train_mode(mode: str | None) -> None:
    """Decide training calls in timing `mode` from now on (None: AUTOFUSE_TRAIN_MODE's again), e.g. to compare
    both on one model (`bench train_layer`'s autofuse-compiled-graph). Decisions made in either mode stay
    cached, so switching back costs nothing; every rank calls it alike."""
    if mode is not None and mode not in modes.MODES:
        raise ValueError(f"set_train_mode({mode!r}): use one of {', '.join(modes.MODES)}, or None")
    STATE.train_mode = mode
    STATE.train_modes.clear()


def library_path(args: tuple) -> bool:
    """Whether a call may need the library path: an input requires grad (grad mode on), a trace runs,
    or an input is a tensor subclass (the generated entry points inline the same test)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return ((grad_enabled() and any(t.requires_grad for t in tensors)) or compiling()
            or any(t.__class__ not in PLAIN for t in tensors))


_library: Any = None  # the custom-op layer, once it installed itself (use_library)


def use_library(layer: Any) -> None:
    """Install the custom-op layer the library path calls (its `route` and `refuse_scaled`):
    autofuse.library does at import."""
    global _library
    _library = layer


def library() -> Any:
    """The installed custom-op layer, loaded by the registry's name for it where none is yet."""
    if _library is None:
        registry.library()  # its import installs it
    return _library


def route(name: str, args: tuple, group: Any, variant: str | None, config: Config | None,
          out: torch.Tensor | None) -> torch.Tensor | None:
    """The library path's result (the custom-op layer's `route`), or None where the call belongs on the hot path."""
    return library().route(name, args, group, variant, config, out)


def refuse_scaled(name: str, args: tuple, group: Any = None) -> None:
    """Raise for a call with FP8 scales that would need the library path (a tensor, scales included,
    requires grad, or a trace runs): the custom ops take no scales yet, and dispatch must neither detach
    a gradient nor run inside a trace. `args`: the positional inputs, then every optional one (None if
    not given). Every rank raises (`tell`)."""
    try:
        library().refuse_scaled(name, args)
    except Exception as exc:
        tell(group, name, exc, args)


def tell(group: Any, name: str, exc: BaseException, args: tuple = ()) -> NoReturn:
    """Raise `exc`, raised on this rank before it took part in a call (agreement.tell: its peers raise
    at once too, naming this rank), as it is where the call is traced (`args` hold fake tensors, or
    Dynamo compiles): a trace runs no call, so nothing is published from one."""
    if tracing(args):
        raise exc
    try:
        world = world_of(group)
    except Exception:  # noqa: BLE001 - no process group to tell: this rank's own error is the one to read
        raise exc from None
    agreement.tell(world, name, exc)


# A call that takes the library path builds no dispatch key: under torch.compile nothing of the hot
# path may be traced (Dynamo 2.11 cannot trace id(None), the default group's key part).
_ENTRY_TEMPLATE = """
def {name}({params}, group=None, *, variant=None, config=None, out=None):
    try:
        via_library = grad_enabled() and ({grad}) or compiling() or {subclass}
        key = None if via_library else ({name!r}, id(group), variant, None if config is None else config_key(config), {key})
    except AttributeError:  # an argument that is not a tensor: the miss path names it, with every rank
        via_library, key = False, None
    if via_library:
        try:
            result = route({name!r}, ({params},), group, variant, config, out)
        except Exception as exc:
            tell(group, {name!r}, exc, ({params},))
        if result is not None:
            return result
    entry = cache.get(key)
    if entry is None:
        return miss(key, {name!r}, ({params},), group, variant, config, out)
    stats.hits += 1
    try:
        result = entry.runner({params}) if out is None else entry.runner({params}, out=out)
    except InvalidInput as exc:
        return take_part(entry, ({params},), out, exc, entry.check)
    if entry.check:
        check(entry, result)
    return result
"""
# An op with keyword-only optional tensors (Op.optional: the FP8 scales): without them, what the plain
# template does; those given follow the positional inputs, and their shape, dtype, device and
# contiguity join the key (as key_of). Such calls (FP8) run through dispatch eagerly: the library
# path (autograd, torch.compile) does not carry the scales, so one that needs it (any input, the scales
# included, requires grad, or a trace runs) raises on every rank (refuse_scaled).
# A non-tensor argument and a cached call's refused arguments are handled as in the plain template.
_ENTRY_TEMPLATE_OPTIONAL = """
def {name}({params}, group=None, *, {optional_params}, variant=None, config=None, out=None):
    try:
        if {none}:
            via_library = grad_enabled() and ({grad}) or compiling() or {subclass}
            args = ({params},)
            key = None if via_library else (
                {name!r}, id(group), variant, None if config is None else config_key(config), {key})
        else:
            via_library = False
            args = ({params},) + tuple(x for x in ({optional},) if x is not None)
            if grad_enabled() and any(x.requires_grad for x in args) or compiling() or any(
                    x.__class__ not in PLAIN for x in args):
                refuse_scaled({name!r}, ({params}, {optional}), group)
            key = ({name!r}, id(group), variant, None if config is None else config_key(config)) + tuple(
                k for x in args for k in (x.shape, x.dtype, x.device, x.is_contiguous()))
    except AttributeError:  # an argument that is not a tensor: the miss path names it, with every rank
        via_library, key = False, None
        args = ({params},) + tuple(x for x in ({optional},) if x is not None)
    if via_library:
        try:
            result = route({name!r}, args, group, variant, config, out)
        except Exception as exc:
            tell(group, {name!r}, exc, args)
        if result is not None:
            return result
    entry = cache.get(key)
    if entry is None:
        return miss(key, {name!r}, args, group, variant, config, out)
    stats.hits += 1
    try:
        result = entry.runner(*args) if out is None else entry.runner(*args, out=out)
    except InvalidInput as exc:
        return take_part(entry, args, out, exc, entry.check)
    if entry.check:
        check(entry, result)
    return result
"""


def entry_point(name: str) -> Callable[..., torch.Tensor]:
    """The public function `autofuse.<name>`, generated from the op's argument names (`Op.args`).

    Its body is the hot path: the library-path test (`library_path`, inlined), one key built inline
    from each argument's shape, dtype, device and contiguity, one dict lookup, the runner call.
    `key_of` builds the same key for `call`/`explain`.
    """
    op = op_of(name)
    params = ", ".join(op.args)
    tensors = [a for a in op.args if a not in op.handles]  # a handle: its static key, never traced
    key = " ".join(f"{a}.key," if a in op.handles else f"{a}.shape, {a}.dtype, {a}.device, {a}.is_contiguous(),"
                   for a in op.args)
    grad = " or ".join(f"{a}.requires_grad" for a in tensors)
    subclass = " or ".join(f"{a}.__class__ not in PLAIN" for a in tensors)
    namespace = {"cache": STATE.cache, "miss": miss, "check": check, "stats": STATE.stats, "config_key": config_key,
                 "route": route, "refuse_scaled": refuse_scaled, "grad_enabled": grad_enabled, "compiling": compiling,
                 "PLAIN": PLAIN, "InvalidInput": InvalidInput, "take_part": take_part, "tell": tell,
                 "__name__": __name__}  # warnings skip this frame as autofuse's own (state.user_stacklevel)
    template = _ENTRY_TEMPLATE_OPTIONAL if op.optional else _ENTRY_TEMPLATE
    exec(template.format(name=name, params=params, key=key, grad=grad, subclass=subclass,  # noqa: S102
                         optional=", ".join(op.optional), optional_params=", ".join(f"{o}=None" for o in op.optional),
                         none=" and ".join(f"{o} is None" for o in op.optional)), namespace)  # our own template
    fn = namespace[name]
    extra = f"; FP8 inputs also take {' and '.join(o + '=' for o in op.optional)}" if op.optional else ""
    fn.__doc__ = (f"{op.description}.\n\nEvery rank of `group` (None: the default group) calls it with its own "
                  f"({params}){extra}; `variant=`/`config=` force a choice, `out=` is written in place.")
    fn.__module__ = "autofuse"
    fn.__qualname__ = name
    return fn


_PUBLIC: dict[str, Callable[..., torch.Tensor]] = {}


def public(name: str) -> Callable[..., torch.Tensor]:
    """`autofuse.<name>`: the op's entry point, made once per process and handed to every caller (the
    package root, autofuse.nn), with the custom-op layer loaded first: the custom ops (autograd,
    torch.compile) exist before any call is traced."""
    fn = _PUBLIC.get(name)
    if fn is None:
        library()
        fn = _PUBLIC[name] = entry_point(name)
    return fn


def explain(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
            config: Config | None = None, training: bool = False) -> Choice:
    """Which variant and config `op(*args)` runs with, and why; builds nothing, no collective.

    `training`: as a training call (autograd records it or runs it in a backward), decided in
    AUTOFUSE_TRAIN_MODE's timing mode. Returns this process's cached decision where there is one; `str()`
    of the result reads well.
    """
    name = op if isinstance(op, str) else op.name
    mode = training_mode(args) if training else None
    entry = STATE.cache.get(key_of(name, group, variant, config, args, mode))
    if entry is not None:
        c = entry.choice
        return Choice(c.op, c.problem, c.variant, dict(c.config), c.reason, c.basis, c.policy_path, c.config_source,
                      True, confirmation=c.confirmation, gain=c.gain, mode=c.mode)
    return decide(op_of(op), world_of(group), args, variant, config, mode)


def runner_of(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
              config: Config | None = None, training: bool = False) -> Any:
    """The runner a cached call of `op(*args)` runs (to call it without dispatch, e.g. to time dispatch);
    `training`: the runner of the training calls (`explain`).

    Raises LookupError if these shapes have not been called yet in this process.
    """
    name = op if isinstance(op, str) else op.name
    mode = training_mode(args) if training else None
    entry = STATE.cache.get(key_of(name, group, variant, config, args, mode))
    if entry is None:
        raise LookupError(f"autofuse.{name}: no cached decision for these arguments; call it once first")
    return entry.runner


def rebuild(group: Any = None) -> None:
    """Clear every fault of `group`'s workspaces so they compute again (collective: every rank calls it).

    After a FlagTimeout or WorkspaceAborted, fix what made a rank late or absent, then call this on
    every rank; cached decisions stay.
    """
    from autofuse.comm.workspace import workspaces

    world = world_of(group)
    for ws in workspaces(world):
        ws.rebuild()
    world.sync()


def reset() -> None:
    """Forget cached decisions, runners, Worlds, policies, warnings and counters (tests)."""
    STATE.reset()


def key_of(name: str, group: Any, variant: str | None, config: Config | None, args: tuple,
           mode: str | None = None) -> tuple | None:
    """The cache key: op, group, overrides, and each input's shape, dtype, device and contiguity (a
    handle: its static key; None where an argument is neither); then the timing mode where a call is
    decided in another than the process's (`training_mode`).

    Contiguity rather than strides: ops that need contiguous inputs reject the others in
    `problem_of` (a new key is a miss, so it runs); ops that take strides read them per call.
    """
    return _key(name, group, variant, None if config is None else config_key(config), args, mode)


def _key(name: str, group: Any, variant: str | None, config_text: str | None, args: tuple,
         mode: str | None = None) -> tuple | None:
    """`key_of` with the config as its canonical text (`config_key`; the custom ops pass it as such)."""
    key: list = [name, id(group), variant, config_text]
    for a in args:
        if isinstance(a, Handle):
            key.append(a.key)
        elif not isinstance(a, torch.Tensor):
            return None  # no cached call takes it: the miss path names it, with every rank
        else:
            key += (a.shape, a.dtype, a.device, a.is_contiguous())
    if mode is not None:
        key.append(mode)
    return tuple(key)


def run(entry: Entry, args: tuple, out: torch.Tensor | None) -> torch.Tensor:
    try:
        result = entry.runner(*args) if out is None else entry.runner(*args, out=out)
    except InvalidInput as exc:
        return take_part(entry, args, out, exc, entry.check)
    if entry.check:
        check(entry, result)
    return result


def take_part(entry: Entry, args: tuple, out: Any, refused: InvalidInput, checked: bool) -> torch.Tensor:
    """This rank's runner refused arguments that the call's cache key admitted (a layout, an alignment
    or an `out=` the key does not show), before launching anything, while the other ranks are already
    in the call: run it on copies the runner takes, so they complete, then return the result (copied
    into `out`) or, where the op itself refuses the arguments or `out` cannot hold the result, raise
    InvalidInput saying that `out` was not written. Only refused calls come here (the hot path pays
    nothing for it)."""
    runner, op = entry.runner, op_of(entry.choice.op)
    copies = tuple(a.clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a for a in args)
    result = runner(*copies)
    if checked:
        check(entry, result)
    try:
        op.problem_of(runner.world, *args)
    except InvalidInput as exc:
        raise told(InvalidInput(f"{exc}; this rank ran the call on copies so that the other ranks complete (out "
                                "was not written)")) from None
    if out is None:
        return result
    if isinstance(out, torch.Tensor) and out.shape == result.shape and out.dtype == result.dtype \
            and out.device == result.device:
        return out.copy_(result)
    raise told(InvalidInput(f"{refused}; this rank ran the call into a buffer of its own so that the other ranks "
                            "complete")) from None


def miss(key: tuple | None, op: str | Op, args: tuple, group: Any, variant: str | None, config: Config | None,
         out: torch.Tensor | None, mode: str | None = None) -> torch.Tensor:
    """A problem this process has not seen: decide (for timing `mode`; None: AUTOFUSE_MODE's), agree,
    confirm, build, cache, run."""
    op = op_of(op)
    if tracing(args):
        raise trace_miss(op.name, args)
    if capturing(args):
        raise CaptureMiss(
            f"autofuse.{op.name} ({shapes_of(args)}): these shapes were first seen inside CUDA-graph capture; "
            "dispatch must build the kernels, allocate heap workspace and check that every rank chose the same "
            "variant, which cannot run during capture. Call it once with the same shapes before capturing "
            "(warm-up).")
    STATE.stats.misses += 1
    world = world_of(group)
    try:
        choice, invalid = decide(op, world, args, variant, config, mode), None
    except Exception as exc:  # noqa: BLE001 - any reason this rank cannot run it (an unknown variant=, ...) is shared
        choice, invalid = None, exc
    agree(world, op.name, choice, invalid)
    if choice.candidates:
        choice = confirm(world, op, choice, args)
    runner, choice = build(world, op, choice)
    STATE.stats.builds += 1
    every = bool(getattr(runner, "workspaces", ())) and (world.device.type == "cpu" or settings.check_every_call())
    entry = Entry(runner, choice, every)
    if key is not None:
        STATE.cache[key] = entry
    try:
        result = runner(*args) if out is None else runner(*args, out=out)
    except InvalidInput as exc:
        return take_part(entry, args, out, exc, checked=True)
    check(entry, result)  # the first call of a problem reads its fault record on every device
    return result


def check(entry: Entry, result: torch.Tensor) -> None:
    """Read the fault record of the entry's workspaces (a device sync) and raise what it holds, leaving NaN
    in `result` (the call's output) first: a call that raises never leaves values in it."""
    runner = entry.runner
    if not getattr(runner, "workspaces", ()):
        return
    if runner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    STATE.stats.checks += 1
    runner.check(result)


def shapes_of(args: tuple) -> str:
    """The tensor arguments' shapes and dtypes, for messages."""
    return ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in args if isinstance(a, torch.Tensor))


def trace_miss(name: str, args: tuple) -> TraceMiss:
    """The error of a call that reaches dispatch while a trace runs, naming the op and the shapes."""
    return TraceMiss(
        f"autofuse.{name} ({shapes_of(args)}) was called while a trace runs (torch.compile, torch.export or fake tensors); "
        "dispatch decides, agrees with every rank and builds kernels only on real tensors, so nothing was "
        f"decided. Ops with a custom op trace as one node (torch.ops.autofuse.<op>); {name!r} has none.")


def tracing(args: tuple) -> bool:
    """Whether a trace runs: Dynamo compiling, or an input is a tensor subclass (FakeTensor, FunctionalTensor)."""
    return compiling() or any(isinstance(a, torch.Tensor) and a.__class__ not in PLAIN for a in args)


def capturing(args: tuple) -> bool:
    """Whether CUDA-graph capture is under way on the current stream (only asked for CUDA inputs)."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()
