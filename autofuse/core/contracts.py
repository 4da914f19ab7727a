"""What core needs of the communication floor's objects, as Protocols, so core imports nothing of
`autofuse.comm`: comm stands on core (its collectives raise core's InvalidConfig and size buffers
with core.sizes), and comm's `World` and `Workspace` are the implementations of these contracts.
"""
from __future__ import annotations

from typing import Protocol

import torch


class World(Protocol):
    """The ranks an op runs on, as core reads them (`autofuse.comm.world.World`: its heap, groups and
    collectives are the ops' business): this process's rank, how many ranks, this rank's device."""

    rank: int
    size: int
    device: torch.device


class Workspace(Protocol):
    """What a runner asks of a workspace it launches on (`autofuse.comm.workspace.Workspace`): whether it
    saw a fault, refusal with that fault's error, and the device-side check after a call."""

    def faulty(self) -> bool:
        """Whether this workspace recorded a fault (host state only: no device sync)."""
        ...

    def refuse_if_faulty(self) -> None:
        """Raise the recorded fault's error, if any."""
        ...

    def check(self) -> None:
        """Raise the fault the last calls recorded on the device (synchronises)."""
        ...
