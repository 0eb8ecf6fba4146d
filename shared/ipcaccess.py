"""Can this process reach an ``ipc://`` endpoint? Asked before connecting, answered at once.

A ZeroMQ connect on ``ipc://`` never reports EACCES: libzmq retries in the background and the
caller only ever sees a timeout. The daemon's access control is the file system (see
docs/ARCHITECTURE.md, "Trust boundary"), so the file system is also where a client learns it
is on the wrong side of it: the socket file must be writable and every directory above it
searchable.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path


class NoDaemon(ConnectionError):
    """Nothing at the endpoint's path: no daemon runs there."""


def check_ipc_endpoint(endpoint: str, require_present: bool = False) -> None:
    """Raise PermissionError when this process may not connect to ``endpoint`` (an ipc path that
    exists but that we cannot reach), NoDaemon when ``require_present`` and nothing is there.
    tcp endpoints, and paths that may still appear (the daemon starting), pass."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    if os.access(path, os.W_OK, effective_ids=True):
        return
    blocker = _blocking_dir(path)
    if blocker is None:
        try:
            os.stat(path)
        except FileNotFoundError:
            if require_present:
                raise NoDaemon(f"no daemon at {path}: the socket file does not exist "
                               "(is the daemon running? is this its runtime directory?)") from None
            return
        blocker = path
    raise PermissionError(f"permission denied: {path} ({who_may(blocker)})")


def _blocking_dir(path: Path) -> Path | None:
    """The first directory above ``path`` we may not search, if any."""
    for directory in reversed(path.parents):
        if directory.exists() and not os.access(directory, os.X_OK, effective_ids=True):
            return directory
    return None


def who_may(path: Path) -> str:
    """Who the file system lets through ``path``: its owner, root, and its group when the group
    has the permission that matters (search on a directory, write on a socket)."""
    try:
        info = os.stat(path)
    except OSError:
        return "the daemon's user or root"
    owner = _name(pwd.getpwuid, info.st_uid, "pw_name")
    group_bit = stat.S_IXGRP if stat.S_ISDIR(info.st_mode) else stat.S_IWGRP
    if info.st_mode & group_bit:
        group = _name(grp.getgrgid, info.st_gid, "gr_name")
        return f"the daemon's user ({owner}), root, or a member of group {group}"
    return f"only the daemon's user ({owner}) or root"


def _name(lookup, number: int, attribute: str) -> str:
    try:
        return getattr(lookup(number), attribute)
    except KeyError:
        return str(number)
