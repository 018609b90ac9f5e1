"""`python -m edgespec`."""
import sys

from edgespec.cli import run

sys.exit(run())
