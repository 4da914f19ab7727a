"""How a tuning job stops: signals, and ranks that never outlive the `autofuse tune` that spawned them.

- **Stop levels** (`STOP`): 1 = finish the current trial, write it, then stop; 2 = abandon the
  current trial (a KeyboardInterrupt in the rank's main thread; the trial is failed and its config
  queued again on the next run). A run stopped by SIGINT exits 130, by SIGTERM 143, never 0.
- **Spawned ranks** are supervised by the parent (`Supervisor`): SIGINT and SIGTERM reach the parent
  (a terminal's Ctrl-C reaches every process of the group, `timeout`, systemd and container runtimes
  often the parent alone), so the ranks ignore both and follow the parent's stop level instead,
  relayed through a shared integer: a signal counts once however many processes received it.
- **No orphans**: the `ParentLink` given to each spawned rank, as it is unpickled in the rank (before
  the rank's own code, rendezvous included, runs), asks Linux to SIGKILL the rank when its parent
  dies (`prctl(PR_SET_PDEATHSIG)`), exits at once if the parent is already gone, and starts a
  watchdog thread that exits the rank when its parent pid changes (the fallback where prctl is not
  available) and relays the stop level.
- **torchrun ranks** have no autofuse parent: each handles SIGINT and SIGTERM itself (`STOP.install()`).
"""
from __future__ import annotations

import _thread
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, Callable

PR_SET_PDEATHSIG = 1
WATCH_S = 0.2
ORPHAN_EXIT = 1


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent exits (Linux), and exit now if the
    parent `parent_pid` is already gone. Returns whether the death signal could be set."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT)
    return armed


class Stop:
    """This process's stop request: `level` 0 (run), 1 (finish the trial, then stop), 2 (abandon it)."""

    def __init__(self) -> None:
        self.level = 0
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.level >= 1

    def exit_code(self) -> int | None:
        """128 + the first signal's number (130 SIGINT, 143 SIGTERM), or None if no signal came."""
        return 128 + self.signum if self.signum is not None else None

    def install(self, supervised: bool = False) -> None:
        """Handle SIGINT and SIGTERM here (torchrun, or no parent), or, `supervised`, ignore them and
        let the parent's `Supervisor` decide (relayed by `ParentLink`). Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        handlers = {signal.SIGUSR1: self._abandon}
        for s in (signal.SIGINT, signal.SIGTERM):
            handlers[s] = signal.SIG_IGN if supervised else self._handle
        for s, h in handlers.items():
            self._previous.setdefault(s, signal.signal(s, h))

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def reset(self) -> None:
        self.level, self.signum = 0, None

    def _handle(self, signum: int, frame: Any) -> None:
        self.raise_to(self.level + 1, signum)
        if self.level >= 2:
            raise KeyboardInterrupt

    def _abandon(self, signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    def raise_to(self, level: int, signum: int | None = None) -> None:
        """Raise the stop level (never lowers it); the first signal decides the exit code."""
        if signum is not None and self.signum is None:
            self.signum = signum
        self.level = max(self.level, min(level, 2))


STOP = Stop()


class ParentLink:
    """Given to every spawned rank as an argument of the function spawn runs; see the module docstring."""

    def __init__(self, parent_pid: int, level: Any, signum: Any):
        self.parent_pid, self.level, self.signum = parent_pid, level, signum

    def __getstate__(self) -> dict:
        return {"parent_pid": self.parent_pid, "level": self.level, "signum": self.signum}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.parent_pid:  # arriving in the rank
            self._attach()

    def _attach(self) -> None:
        die_with_parent(self.parent_pid)
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):  # the parent relays them (before our handlers exist)
                signal.signal(s, signal.SIG_IGN)
        threading.Thread(target=self._watch, daemon=True, name="autofuse-parent-watch").start()

    def _watch(self) -> None:
        interrupted = False
        while True:
            if os.getppid() != self.parent_pid:
                os._exit(ORPHAN_EXIT)
            level = int(self.level.value)
            if level > STOP.level:
                STOP.raise_to(level, int(self.signum.value) or None)
                if level >= 2 and not interrupted:
                    interrupted = True
                    _thread.interrupt_main(signal.SIGUSR1)  # runs STOP's SIGUSR1 handler: KeyboardInterrupt
            threading.Event().wait(WATCH_S)


class Supervisor:
    """The parent's side: SIGINT / SIGTERM raise the stop level of every spawned rank (a context
    manager around `spawn`). The second signal also raises KeyboardInterrupt in the parent, so that
    spawn stops waiting (it gives the ranks a grace period, then terminates them)."""

    def __init__(self, say: Callable[[str], None] = lambda text: None):
        ctx = multiprocessing.get_context("spawn")
        self._level = ctx.RawValue("i", 0)
        self._signum = ctx.RawValue("i", 0)
        self.say = say
        self.count = 0
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def link(self) -> ParentLink:
        return ParentLink(os.getpid(), self._level, self._signum)

    def exit_code(self) -> int | None:
        return 128 + self.signum if self.signum is not None else None

    def __enter__(self) -> "Supervisor":
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
            self._signum.value = signum
        self._level.value = min(self.count, 2)
        name = signal.Signals(signum).name
        if self.count == 1:
            self.say(f"{name}: stopping after the current trial (Ctrl-C again to abandon it)")
            return
        self.say(f"{name}: abandoning the current trial")
        raise KeyboardInterrupt
