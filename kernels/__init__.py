"""Triton device code of autofuse: `shmem` (the Iris-style device API), then one module per op."""
