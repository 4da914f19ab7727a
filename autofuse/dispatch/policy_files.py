"""Which policy dispatch uses on this machine: AUTOFUSE_POLICY, else the best match in the models folders.

Search order (first match wins): AUTOFUSE_MODELS_DIR's folders, this user's fitted policies
(`autofuse fit`'s default output, $XDG_DATA_HOME/autofuse/models), models/ beside the package, the
package's own models/, then <prefix>/share/autofuse/models (the installed shipped ones). Among the
valid files fitted on this machine's hardware kind (GPU model, count and links of the visible GPUs:
`environment.hardware_match`), preferred in order: the timing mode (AUTOFUSE_MODE), this machine
over another host of the kind (whose decisions are all confirmed on first use), the same software,
earlier folders. None: BSP for every op with one warning.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autofuse.core import settings
from autofuse.comm.world import World
from autofuse.dispatch.state import STATE, warn_once


def models_dirs() -> list[Path]:
    """The folders searched for policies, in order (existing ones only, each once)."""
    package = Path(__file__).resolve().parents[1]
    dirs = [*settings.models_dirs(), settings.user_models_dir(), package.parent / "models", package / "models",
            Path(sys.prefix) / "share" / "autofuse" / "models"]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def find_policy(fingerprint: dict, mode: str | None = None) -> Path | None:
    """The first valid policy fitted on this hardware kind, or None. Preferred, in order: the timing
    `mode`, this machine (a policy from another host of the kind is used with every decision
    confirmed), the same software (likewise), earlier folders."""
    from autofuse.dispatch.policy import read_file, validate
    from autofuse.measure.environment import hardware_id, hardware_match, software_id

    found: list[tuple[bool, bool, bool, int, str, Path]] = []
    for index, d in enumerate(models_dirs()):
        for path in sorted(d.glob("*.json")):
            data, _ = read_file(path)
            theirs = data.get("fingerprint") if isinstance(data, Mapping) else None
            if not isinstance(theirs, Mapping) or hardware_id(theirs) != fingerprint["hardware_id"]:
                continue  # not a policy, or another hardware kind's: never used here, so not validated
            if validate(data) is None:
                found.append((data.get("mode") != mode, hardware_match(theirs, fingerprint) != "machine",
                              software_id(theirs) != fingerprint["software_id"], index, str(path), path))
    return min(found)[-1] if found else None


def no_policy_reason(fp: dict) -> str:
    """Why no policy was found, naming every place searched (existing or not) and what runs instead."""
    searched = ["AUTOFUSE_POLICY (unset)",
                "AUTOFUSE_MODELS_DIR (" + (", ".join(map(str, settings.models_dirs())) or "unset") + ")",
                f"{settings.user_models_dir()} (where autofuse fit writes)",
                *(str(d) for d in models_dirs() if d not in (*settings.models_dirs(), settings.user_models_dir()))]
    forced = settings.variant_text()
    runs = (f"ops that AUTOFUSE_VARIANT={forced} does not force run bsp" if forced else
            "every op runs bsp unless variant= or AUTOFUSE_VARIANT forces another")
    return f"no policy fitted on this machine's hardware kind (fingerprint {fp['id']}) in {'; '.join(searched)}: {runs}"


def policy_file(fingerprint: dict, mode: str) -> Path | None:
    """The policy file decisions in timing `mode` load on this hardware: AUTOFUSE_POLICY, else `find_policy`'s."""
    return settings.policy_path() or find_policy(fingerprint, mode)


def policy_for(world: World, mode: str | None = None) -> Any:
    """The Policy decisions on `world`'s device kind use in timing `mode` (None: AUTOFUSE_MODE's), loaded once
    per process, kind and mode: the file fitted in that mode where this machine's kind has one, else another."""
    if STATE.forced_policy is not None:
        return STATE.forced_policy
    kind = world.device.type
    mode = mode or settings.mode(kind)
    if (kind, mode) not in STATE.policies:
        from autofuse.dispatch.policy import Policy
        from autofuse.measure import environment

        STATE.stats.policy_loads += 1
        fp = environment.fingerprint(kind)
        path = policy_file(fp, mode)
        if path is not None:
            STATE.policies[kind, mode] = Policy.load(path, fp)
        else:
            reason = no_policy_reason(fp)
            warn_once(f"autofuse: {reason}. To fit one here: autofuse tune, then autofuse fit.")
            STATE.policies[kind, mode] = Policy.bsp(reason)
    return STATE.policies[kind, mode]


def set_policy(policy: Any) -> None:
    """Use `policy` (a Policy, a JSON path, or None to go back to the default search) from now on.

    Clears cached decisions: every rank must call it alike.
    """
    if policy is not None and not hasattr(policy, "decide"):
        from autofuse.dispatch.policy import Policy

        policy = Policy.load(policy)
    STATE.forced_policy = policy
    STATE.policies.clear()
    STATE.confirmed.clear()
    STATE.cache.clear()
