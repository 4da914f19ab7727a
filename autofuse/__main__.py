"""`python -m autofuse` runs the command line (same as the `autofuse` script)."""
from autofuse.cli import main

main()
