"""`public.<op>`: the very function `autofuse.<op>` names (dispatch's entry point, `dispatch.public`),
looked up on first use, for the models to call.

autofuse.nn never imports the package root, which stands above it (it hands out `autofuse.nn` and
`autofuse.parallelize`); and importing autofuse.nn loads neither dispatch nor Triton. A module (not an
object) so that torch.compile, tracing a first call, reads the attribute as it reads `autofuse.<op>`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def __getattr__(name: str) -> Callable[..., Any]:
    from autofuse.dispatch import entry

    fn = entry.public(name)
    globals()[name] = fn  # later lookups are plain module attributes
    return fn
