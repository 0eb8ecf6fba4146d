"""``python -m modelwarden``: the same as the ``modelwarden`` command."""

import sys

from modelwarden.supervisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
