"""Choice: which variant and config run a problem, and why: the one decision record of dispatch.

The policy returns one (`Policy.decide`), dispatch adds the candidates it confirms and the
confirmation's measurements, the cache keeps it beside the runner and `autofuse.explain` returns it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofuse.core.op import Config, Problem, config_key

BASES = ("override", "env", "measured", "confirmed", "policy", "unsure", "fallback")
NO_PARAMETERS = "no parameters"  # the config source of a variant that takes none (bsp of the GEMM ops)


@dataclass
class Choice:
    """Which variant and config run a problem, and why (what `explain` returns).

    basis: override (variant= argument) | env (AUTOFUSE_VARIANT) | measured (the problem was tuned) |
    confirmed (measured on first use, now or earlier on this machine) | policy (the model's pick) |
    unsure (predicted gain within the model's error, so BSP) | fallback (no usable policy or model).
    `gain` is the predicted or measured log gain over BSP where the policy knows one. `mode`: the timing
    mode it was decided for (its policy's and confirmation's: AUTOFUSE_MODE, or a training call's
    AUTOFUSE_TRAIN_MODE).
    """

    op: str
    problem: Problem
    variant: str
    config: Config
    reason: str
    basis: str
    policy_path: str = ""
    config_source: str = ""
    cached: bool = False
    candidates: list = field(default_factory=list)  # (variant, config) to confirm on first use, best first: the first
    # AUTOFUSE_CONFIRM_K that build and run are timed, the rest stand in for those that fail
    keep: int = 0  # how many of `candidates` to time (AUTOFUSE_CONFIRM_K, + 1 where torch's op was added)
    confirmation: Any = None  # the confirm.Confirmation this decision came from (its costs, timings)
    gain: float | None = None
    mode: str = ""

    def __str__(self) -> str:
        config = (f"none ({self.variant} takes no parameters)" if not self.config else config_key(self.config)
                  + (f"  ({self.config_source})" if self.config_source else ""))
        label = f"{self.basis}: "  # most reasons open with their basis: said once, in brackets
        reason = self.reason[len(label):] if self.reason.startswith(label) else self.reason
        lines = [f"{self.op}: {self.problem.key}",
                 f"  variant: {self.variant}",
                 f"  config:  {config}",
                 f"  why:     [{self.basis}] {reason}"]
        if self.mode:
            lines.append(f"  mode:    {self.mode} (the timing mode it was decided for)")
        if self.policy_path:
            lines.append(f"  policy:  {self.policy_path}")
        if self.cached:
            lines.append("  (cached decision of this process)")
        return "\n".join(lines)
