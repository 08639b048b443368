"""python -m attncc: the command line (attncc/cli.py)."""
import sys

from .cli import main

sys.exit(main())
