"""Measurement: timing, the tuning store, the environment fingerprint."""
