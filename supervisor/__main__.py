"""``python -m supervisor``: the same as the ``modelwarden`` command."""

import sys

from supervisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
