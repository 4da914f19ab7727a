"""Op machinery: op/problem/variant/config, runner, registry, features, the GEMM config, model shapes, size helpers."""
