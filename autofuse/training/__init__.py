"""Training side of autofuse: tuning, fitting, benchmarks (optuna, scikit-learn; never imported at run time)."""
