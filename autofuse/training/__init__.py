"""Training side of autofuse: tuning, fitting and benchmarks (imports optuna and scikit-learn; the runtime never imports it)."""
