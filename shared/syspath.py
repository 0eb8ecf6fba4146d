"""A worker's import path: the configured ``python_path``, then the interpreter's own paths.

Nothing of the daemon's working directory. ``python -m modelwarden`` puts the working directory
first on ``sys.path`` (``-c`` puts ``''``, the same thing), and multiprocessing's spawn copies
the parent's ``sys.path`` into every worker: started from a directory another user can write,
a module planted there under the configured module's name would run in the worker, as the
daemon's user. So the supervisor computes the path once (``worker_path``) for the worker
(worker/main.py sets ``sys.path`` to exactly it before anything is imported by name) and for the
model versions (supervisor/fleet/versions.py looks for the factory's file on the same path). A
directory the operator wants, the working directory included, goes in ``python_path``.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

# What Python put first for the script or ``-m`` that started this process (none with -P);
# read at import, before anyone edits sys.path. In a spawned worker it is the parent's, since
# spawn sets sys.path before it imports anything of ours.
_SCRIPT_ENTRY = sys.path[0] if sys.path and not sys.flags.safe_path else None


def interpreter_paths() -> list[str]:
    """``sys.path`` without the working directory: no ``''`` or relative entry, none that is
    the working directory, and not the script's (or ``-m``'s) entry. What is left is the
    interpreter's own: the standard library, site-packages and what their .pth files add,
    and PYTHONPATH."""
    here = _real(os.getcwd())
    return [entry for entry in sys.path
            if entry and os.path.isabs(entry) and entry != _SCRIPT_ENTRY and _real(entry) != here]


def worker_path(configured: Iterable[str]) -> list[str]:
    """``configured`` (already resolved) first, then the interpreter's paths; each once."""
    return list(dict.fromkeys([*configured, *interpreter_paths()]))


def _real(path: str) -> str:
    try:
        return os.path.realpath(path)
    except OSError:
        return path
