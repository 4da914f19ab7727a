"""Benchmarks: `autofuse bench`'s targets, kernel profiles, the benchmark layer and the results tables (imports rich; the runtime never imports it)."""
