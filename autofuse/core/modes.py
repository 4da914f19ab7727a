"""Timing modes, one definition: `eager` (back-to-back launches, launch cost included) and `graph`
(captured in a CUDA graph and replayed: launch tax removed, as inference servers run decode)."""
from __future__ import annotations

MODES = ("eager", "graph")


def supported(device_type: str) -> tuple[str, ...]:
    """The modes a device kind can time: graph mode needs CUDA graphs."""
    return MODES if device_type == "cuda" else ("eager",)


def default(device_type: str) -> str:
    """The mode decisions and searches are made for unless told otherwise: graph on GPUs, eager on CPU."""
    return "graph" if device_type == "cuda" else "eager"


DISPLAY_ORDER = ("graph", "eager")  # tables and reports show graph mode first (what inference servers run)
