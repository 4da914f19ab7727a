"""Training side of autofuse: tuning with Optuna, fitting with scikit-learn (the runtime never imports it)."""
