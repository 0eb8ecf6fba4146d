"""``python -m modelwarden``: the same as the ``modelwarden`` command (modelwarden/cli.py)."""

import sys

from modelwarden.cli import main

if __name__ == "__main__":
    sys.exit(main())
