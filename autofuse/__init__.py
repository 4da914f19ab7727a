"""autofuse: per-call choice between bulk-synchronous and fused multi-GPU Triton kernels.

`autofuse.ag_gemm(a, b, group=...)`, `gemm_rs`, `gemm_ar`, `flash_decode` and `explain` are the
runtime entry points (`autofuse.dispatch`). They are imported on first use, so `import autofuse`
stays cheap: no torch import, no process group, no GPU work, no file or database I/O.
"""
__version__ = "0.1.0"

_LAZY = {
    "ag_gemm": "autofuse.dispatch",
    "gemm_rs": "autofuse.dispatch",
    "gemm_ar": "autofuse.dispatch",
    "flash_decode": "autofuse.dispatch",
    "call": "autofuse.dispatch",
    "explain": "autofuse.dispatch",
    "set_policy": "autofuse.dispatch",
    "Policy": "autofuse.policy",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
