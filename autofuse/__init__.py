"""autofuse: per-call choice between bulk-synchronous and fused multi-GPU Triton kernels."""
__version__ = "0.1.0"
