"""Host side of each op: inputs, float64 reference, variants (one module per op)."""
