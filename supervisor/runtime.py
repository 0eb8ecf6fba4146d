"""The runtime directory: sockets live there, and a locked pid file says whose it is.

Binding an ``ipc://`` endpoint replaces any socket file already at that path, so a second daemon
on the same directory would silently steal the first one's clients: the lock prevents that.
"""

from __future__ import annotations

import fcntl
import grp
import os
from pathlib import Path
from typing import IO


class DaemonError(RuntimeError):
    """The daemon cannot start (runtime directory, lock, endpoints)."""


def claim_runtime_dir(runtime: Path, group: str | None) -> IO:
    """Create the directory (0700, or 0770 for ``group``), lock its pid file and write our pid.
    The returned file holds the lock until it is closed (or the process dies)."""
    try:
        runtime.mkdir(parents=True, exist_ok=True)
        os.chmod(runtime, 0o770 if group else 0o700)
        if group:
            os.chown(runtime, -1, grp.getgrnam(group).gr_gid)
        lock = open(runtime / "modelwarden.pid", "a+")
    except (OSError, KeyError) as exc:
        raise DaemonError(f"cannot prepare runtime directory {runtime}: {exc}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        other = lock.read().strip() or "?"
        lock.close()
        raise DaemonError(f"another modelwarden daemon (pid {other}) uses {runtime}") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def share_with_group(path: Path, group: str) -> None:
    """An ipc socket file members of ``group`` may connect to: group-owned, mode 0660."""
    try:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
        os.chmod(path, 0o660)
    except (OSError, KeyError) as exc:
        raise DaemonError(f"cannot give {path} to group {group}: {exc}") from None
