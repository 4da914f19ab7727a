"""Tuning: `autofuse tune`'s rank loop, studies, store and fitting the policy (imports optuna and scikit-learn; the runtime never imports it)."""
