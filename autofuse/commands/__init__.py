"""CLI commands: each module here defines `register(app)` and is picked up by `autofuse.cli`."""
