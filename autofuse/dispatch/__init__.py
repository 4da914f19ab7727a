"""Runtime dispatch: `autofuse.ag_gemm(a, b, group=...)` and friends run the variant the policy picks.

Modules: `entry` (entry points, hot path, miss path), `decide` (override, confirmed, policy;
confirming), `agreement` (every rank agrees), `policy_files` (which policy file), `policy` (a loaded
policy's decisions), `confirm` (measuring candidates), `online` (this machine's confirmed
measurements), `choice` (the decision record), `state` (what the process keeps). Every AUTOFUSE_*
variable is read in `autofuse.core.settings`.

Hot path (a cached problem): a key from the op name, the group and each input's shape, dtype,
device and contiguity, one dict lookup, the runner call. No I/O, no collective, no policy walk.

Entry points: `autofuse.<op>(*args, group=None, *, variant=None, config=None, out=None)` is
generated from the op's declared argument names (`Op.args`) the first time it is used, so an op
needs no hand-written entry point; the generated code builds the cache key inline.

Miss path (a problem this process has not seen, per op/group/shapes): the op's `problem_of`
validates the inputs; the decision comes from, in order, the `variant=` argument,
`AUTOFUSE_VARIANT=op:variant,...` (`*:variant` for every op), the policy. The policy is
`AUTOFUSE_POLICY` (a JSON path), else the best match for this machine's hardware kind (GPU model,
count and links of the visible GPUs; this machine's own policies first, another host's served with
every decision confirmed, `explain` naming the layer it matched by) in the folders
`autofuse/dispatch/policy_files.py` searches, in order: AUTOFUSE_MODELS_DIR, the user folder
`autofuse fit` writes to ($XDG_DATA_HOME/autofuse/models), models/ beside the package, the package's
own models/, <prefix>/share/autofuse/models (preferring the call's timing mode: `AUTOFUSE_MODE`, default
graph on GPUs; for a training call, one autograd records or runs in a backward, `AUTOFUSE_TRAIN_MODE`,
default eager, under a cache key of its own where the two differ: `entry.training_mode`);
else BSP for every op not forced, with a one-time warning. Then every rank agrees: each publishes its validation outcome and a hash of (problem,
variant, config) through the job's store and waits, bounded (the wait budget + 2 s), for all the
others. If any rank's input was invalid, every rank raises InvalidInput naming that rank and the
reason; if the choices or the settings every rank must share differ, every rank raises
DispatchMismatch naming them; a rank that raised before it reached the agreement (the library
path's checks and settings) publishes that in the same round (agreement.tell). Peers that do not come
within a second are stopped where they wait inside a call they cached (autofuse/comm/rounds.py: their
workspaces' status, their gloo collectives) and raise PeerRefused / CollectiveTimeout naming this rank;
only a rank that never answers (it died) leaves the others to the wait's bound, and a rank left alone
takes the round back so its next agreement pairs with the others'. All of it happens before any
kernel is built or launched. Then the runner is built and cached.

One rank's mistake on a cached call (entry.take_part): a runner checks its arguments before it
launches anything; where the key admitted them but the runner refuses them (a misaligned or
strided tensor, a wrong `out=`), that rank runs the call on copies the runner takes, so the other
ranks (already in the call) complete, then returns or raises InvalidInput. The hot path pays a
`try` for it, nothing more.

CUDA graphs: a cached problem is safe to capture (the runner keeps its epochs on the device). A
miss during capture raises `CaptureMiss`: building a runner allocates heap workspace collectively
and the rank check is a collective, neither of which may run inside a capture; call each problem
once before capturing (warm-up), as inference servers already do.

Autograd and tracing: a call whose inputs require grad, or made while torch.compile / torch.export
traces, goes to the op's torch custom op (autofuse/library: autograd, fake implementation), which
dispatches when the graph runs; a miss reached while tracing raises `TraceMiss` naming the op and
shapes, so the first-call agreement never runs inside a trace.

Confirm on first use (autofuse/dispatch/confirm.py): when the decision for a problem rests on a prediction
(the policy never measured this problem, or the policy was fitted with other software), every rank
measures the policy's top candidates (AUTOFUSE_CONFIRM_K, default 3, plus BSP; one that cannot run
here gives its place to the next) on the caller's inputs in lockstep, with the tuner's timer, and runs the fastest correct one (`explain` shows the
times and the cost, build and timing apart); the measurements go (source `online`) to this
machine's online store (AUTOFUSE_ONLINE_DB, default <user cache>/autofuse/online-<hardware id>.db),
which later processes read first (basis `confirmed`) and `autofuse fit` reads too. On by default
on GPUs, off on the CPU emulation; AUTOFUSE_ONLINE=0/1 switches it. `warmup` (autofuse/dispatch/warmup.py)
makes these first calls ahead of serving.

Faults: a runner refuses to run on a workspace that saw a fault (it reads a host-visible mirror of
the fault record, no device sync) until `autofuse.rebuild(group)` is called on every rank. The full
fault record is read (a device sync) after every call on CPU, after the first call of a problem on
GPUs, and after every call when AUTOFUSE_CHECK=1.
"""
from __future__ import annotations

from autofuse.dispatch.agreement import DispatchMismatch, agree_timeout_s
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.entry import (CaptureMiss, TraceMiss, call, entry_point, explain, public,
                                    rebuild, reset, runner_of, set_train_mode)
from autofuse.dispatch.online import online_db
from autofuse.dispatch.policy_files import find_policy, models_dirs, set_policy
from autofuse.dispatch.state import STATE

stats = STATE.stats

__all__ = ["CaptureMiss", "TraceMiss", "Choice", "DispatchMismatch", "STATE", "agree_timeout_s", "call", "entry_point", "explain",
           "find_policy", "models_dirs", "online_db", "public", "rebuild", "reset", "runner_of", "set_policy", "set_train_mode", "stats"]
